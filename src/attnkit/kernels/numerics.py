"""The dtypes attention computes in, and scalar constants made in them (shared by the explicit and the
tiled paths)."""

import numpy as np
from keras import ops

HALF_DTYPES = ("float16", "bfloat16")


def scores_dtype(dtype):
    """The scores' dtype: float32 for half-precision inputs (docs/decisions.md item 5)."""
    return "float32" if dtype in HALF_DTYPES else dtype


def constant(value, dtype):
    """The Python or NumPy number `value` as a scalar tensor of `dtype`, rounded once, to `dtype`.

    `ops.cast(value, "float64")` goes through float32 on tensorflow: a scale loses its last digits,
    and float64's minimum does not convert at all."""
    return ops.convert_to_tensor(np.asarray(value, dtype=dtype))
