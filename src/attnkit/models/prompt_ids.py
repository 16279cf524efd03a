"""Token-id prompts of the language model, checked before generation as the embedding layers check
token ids (`layers/_token_ids.py`): integers, or floats holding whole numbers, in [0, vocab_size)
(docs/decisions.md item 106).

`int(1.5)` is 1 and `int("7")` is 7: converting each id with `int` ran the model on ids nobody gave.
Each prompt is checked as a whole here, by name and index, before anything is padded or cached.

Legend: B prompts, V vocabulary.
"""

import numbers

import numpy as np

from attnkit.layers._token_ids import check_values
from attnkit.ops.masks import shape_str


def _as_array(ids, name):
    """`ids` (a list, a NumPy array or a backend tensor) as a NumPy array, refusing what is no array of numbers."""
    if isinstance(ids, (str, bytes)) or ids is None or isinstance(ids, numbers.Number) and not hasattr(ids, "shape"):
        raise TypeError(f"`{name}` must be a list of token ids. Received: {name}={ids!r}")
    if hasattr(ids, "detach"):  # torch: NumPy 2 warns on np.asarray(tensor)
        ids = ids.detach().cpu().numpy()
    elif isinstance(ids, (list, tuple)) and any(isinstance(t, (bool, np.bool_)) for t in ids):
        # NumPy makes [1, True] an int array: a bool among ids is refused, not read as 1
        raise TypeError(f"`{name}` must hold integer token ids, not bools. Received: {name}={list(ids)[:8]!r}")
    try:
        array = np.asarray(ids)
    except (ValueError, TypeError):  # a list holding lists of other lengths: "inhomogeneous shape"
        raise ValueError(f"`{name}` must be a flat list of token ids (numbers). Received: {name}={ids!r}"[:400]) from None
    if array.dtype.kind not in "iuf" or array.dtype == bool:
        kind = {"b": "bool", "U": "string", "S": "bytes", "O": "object"}.get(array.dtype.kind, str(array.dtype))
        raise TypeError(f"`{name}` must hold integer token ids. Received: {name} of {kind} values: {ids!r}"[:400])
    return array


def check_prompt(ids, vocab_size, name="prompt"):
    """One prompt as a list of int: a non-empty flat list (or 1-D array) of integers, or floats holding
    whole numbers, in [0, vocab_size).

    Raises:
        TypeError: strings, bools, None or other objects among the ids, or no list at all.
        ValueError: an empty prompt, nested lists, fractional, non-finite or out-of-range ids.
    """
    array = _as_array(ids, name)
    if array.ndim != 1:
        raise ValueError(f"`{name}` must be a flat list of token ids. Received: {name} of shape {shape_str(array.shape)}")
    if array.size == 0:
        raise ValueError(f"`{name}` must hold at least one token id. Received: {name}=[] (an empty prompt)")
    check_values(array, vocab_size, name, array.dtype.kind == "f")
    return array.astype("int64").tolist()


def check_prompts(prompts, vocab_size, name="prompts"):
    """A batch of prompts as a list of B lists of int (B may be 0); each is checked by `check_prompt` as
    `prompts[i]`.

    Raises:
        TypeError: `prompts` is not a list of prompts (a str, None, a number, a flat list of ids).
        ValueError: see `check_prompt`.
    """
    if hasattr(prompts, "detach"):
        prompts = prompts.detach().cpu().numpy()
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__iter__") or isinstance(prompts, dict):
        raise TypeError(f"`{name}` must be a list of token-id lists. Received: {name} of type {type(prompts).__name__}")
    if isinstance(prompts, np.ndarray) and prompts.ndim != 2:
        raise ValueError(f"`{name}` must be a list of token-id lists, (B, T). Received: {name} of shape {shape_str(prompts.shape)}")
    rows = list(prompts)
    if rows and all(isinstance(t, numbers.Number) for t in rows):
        raise TypeError(f"`{name}` must be a list of token-id lists; for one prompt, give [ids]. Received: {name}={rows[:8]!r}")
    return [check_prompt(row, vocab_size, f"{name}[{i}]") for i, row in enumerate(rows)]
