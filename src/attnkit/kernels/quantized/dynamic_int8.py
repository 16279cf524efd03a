"""int8 products with the activations quantized per call: dynamic quantization, as torch's and ONNX
Runtime's `quantize_dynamic` run an encoder, but with a scale per row of x (docs/decisions.md item 141).

The weights are `weight_only.quantize_int8`'s: int8 q_w (N, K), a symmetric scale s_w per output
row. Each call quantizes every row of x (..., K), a token's vector, by its own largest magnitude m:

    s = m / Q_MAX,   q_x = round(x / s)     (m = max_k |x[.., k]|, q_x in [-Q_MAX, Q_MAX])
    y[.., n] = s s_w[n] sum_k q_x[.., k] q_w[n, k] + b[n]

Q_MAX is 63: 7 bits, not 8 (torch's `reduce_range`), because on CPUs without VNNI the integer
kernel adds pairs of u8 x s8 products in 16 bits, which 255 * 127 * 2 would overflow.
torch's and ONNX Runtime's `quantize_dynamic` take one scale for the whole tensor instead: its rows
then depend on each other (a sentence's embedding on the batch it is encoded with), and a token
with large values coarsens every other's. On all-MiniLM-L6-v2, per row keeps the embeddings within
cosine 0.99 of float32's where one scale per tensor fell to 0.96 (docs/performance.md).

Error: |y - x W^T| <= (s / 2) sum_k |W[n, k]| + |x| |W - s_w q_w|^T per output, W the float weights
(tests/kernels/test_dynamic_int8.py against a float64 reference).

On torch's CPU (float32 x outside autograd) the integer product is fbgemm's
`quantized::linear_dynamic`, the kernel of torch's `quantize_dynamic`, on a weight packed once and
kept. It quantizes its input to [0, 127] with one scale and zero point from the input's range, so
it is given x / f, f = m * 63.5 / Q_MAX, with two more rows, [-1, 0, ...] and [1, 0, ...], that
make that range exactly [-1, 1]: its scale is then 2 / 127, its zero point 64, and its integers
64 + round(63.5 x / f) = 64 + round(x / s), the formula above for each row; the result is
multiplied back by f. Elsewhere the formula runs in `keras.ops`, with the gradient of the
float product (a straight-through estimate, as Keras's int8 layers train). A row with an infinity or
a NaN has no scale: that row's product is the float one of the dequantized weights, so they come
out as float arithmetic gives them (on torch such a batch runs the formula, its other rows exactly
as before within float32 rounding). A torch quantized engine other than fbgemm's ("x86",
"fbgemm"; qnnpack requantizes otherwise) runs the formula too. An empty x gives the bias alone.

Legend: N outputs, K inputs, R rows of x.
"""

import threading
import warnings
import weakref

import keras
from keras import ops

from attnkit.kernels import kept

Q_MAX = 63

_PACKED = {}  # id(values) -> (`kept.stamp`s of values and scale, packed fbgemm weight)
_LOCK = threading.Lock()


def quantize_activations(x):
    """(q_x, s) of x (..., K) by the formula above in keras ops: q_x float32 (..., K), s (..., 1)."""
    m = ops.max(ops.abs(x), axis=-1, keepdims=True)
    step = m / Q_MAX
    # an all-zero row, or one whose step flushes to zero (XLA's CPU code flushes subnormals): any step
    # gives q_x = 0, the product of x's rounding at float32's resolution
    step = ops.where(step > 0, step, 1.0)
    return ops.clip(ops.round(x / step), -Q_MAX, Q_MAX), step


def linear(x, values, scale, bias=None):
    """x (..., K) -> (..., N): x W^T + bias with W = scale * values, x quantized as above.

    Args:
        x: float32 (..., K). values: int8 (N, K). scale: float32 (N, 1). bias: (N,) or None.
    """
    n = values.shape[0]
    if any(d == 0 for d in x.shape):  # no rows, or K = 0 (an empty sum): the bias alone
        y = ops.zeros((*x.shape[:-1], n), "float32")
        return y if bias is None else ops.add(y, bias)
    if _fbgemm_takes(x, values):
        import torch

        k = x.shape[-1]
        rows = x.reshape(-1, k)  # (R, K)
        m = rows.abs().amax(dim=1, keepdim=True)  # (R, 1): max |x| (NaN where a row has one); faster than aminmax or an inf-norm
        f = m.clamp_min_(torch.finfo(torch.float32).tiny).mul_(63.5 / Q_MAX)  # (R, 1); inf past float32's range
        # a non-finite row, or one whose scale overflows (|x| > 3.3e38), takes the formula below, all
        # rows with it: the torch result of a batch is independent of its rows where all are finite
        if bool(torch.isfinite(f).all()):
            unit = torch.empty(rows.shape[0] + 2, k, dtype=torch.float32)  # (R + 2, K): x / f, then two rows fixing the range
            torch.mul(rows, f.reciprocal(), out=unit[:-2])  # a product: faster than a division, within the rounding the test allows
            unit[-2:] = 0.0
            unit[-2, 0], unit[-1, 0] = -1.0, 1.0
            y = torch.ops.quantized.linear_dynamic(unit, _packed(values, scale), True)[:-2]  # (R, N), fresh
            y = y.mul_(f) if bias is None else y.mul_(f).add_(bias)
            return y.reshape(*x.shape[:-1], y.shape[-1])
    w = ops.multiply(ops.cast(values, "float32"), scale)  # (N, K)
    x = ops.cast(x, "float32")
    q, step = quantize_activations(ops.stop_gradient(x))
    # the rounded x, with the float x's gradient (straight through); a non-finite row (no step) as it is
    rounded = ops.where(ops.isfinite(step), x + ops.stop_gradient(q * step - x), x)
    y = ops.matmul(rounded, ops.transpose(w))  # (..., N)
    return y if bias is None else ops.add(y, bias)


def _fbgemm_takes(x, values):
    if keras.backend.backend() != "torch" or not ops.is_tensor(x):
        return False
    import torch

    if x.dtype != torch.float32 or x.device.type != "cpu" or values.device.type != "cpu":
        return False
    if torch.is_grad_enabled() and x.requires_grad:
        return False  # fbgemm's kernel has no gradient
    # the engine that packs and multiplies: fbgemm's ("x86" runs it too); qnnpack (ARM's default)
    # requantizes differently, 1-3% off the formula, so there the formula runs instead
    return torch.backends.quantized.engine in ("x86", "fbgemm")


def _packed(values, scale):
    """fbgemm's packed weight for int8 `values` (N, K) and `scale` (N, 1), made once per pair of tensors
    and made anew when either changes (`kept.stamp`: in place, a new tensor, or new `.data`)."""
    import torch

    n = values.shape[0]

    def pack():
        with warnings.catch_warnings():
            # torch marks its quantized tensor types for removal; fbgemm's packing still takes only them
            warnings.simplefilter("ignore", UserWarning)
            weight = torch._make_per_channel_quantized_tensor(
                values.contiguous(), scale.reshape(n).double(), torch.zeros(n, dtype=torch.long), 0
            )
            return torch.ops.quantized.linear_prepack(weight, None)

    if values.is_inference() or scale.is_inference():
        return pack()  # made under torch.inference_mode: no version counter tells a change, so nothing is kept
    key = id(values)
    with _LOCK:
        entry = _PACKED.get(key)
        if entry is not None and kept.current(entry[0], (values, scale)):
            return entry[1]
        stamps = [kept.stamp(values), kept.stamp(scale)]  # before packing: a write meanwhile packs anew next call
    packed = pack()
    with _LOCK:
        if entry is None or entry[0][0][0]() is not values:
            weakref.finalize(values, _PACKED.pop, key, None)  # once per tensor: gone with it
        _PACKED[key] = (stamps, packed)
    return packed
