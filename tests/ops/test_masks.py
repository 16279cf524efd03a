"""Mask helpers: exact values, the True = may attend convention, converters and their errors.

Legend: B batch, T_q/T_k query/key lengths, h heads.
"""

import keras
import numpy as np
import pytest

import reference
from attnkit.ops import (
    MaskDtypeError,
    causal_mask,
    combine_masks,
    from_hide_mask,
    from_key_padding_mask,
    fused_attention,
    padding_mask,
    scaled_dot_product_attention,
)
from backend_utils import to_numpy

IDS = np.array([[5, 7, 9, 0, 0], [3, 0, 4, 0, 8]])  # (B, T) with a pad in the middle


def test_padding_mask_default_pad_id():
    mask = to_numpy(padding_mask(IDS))
    assert mask.dtype == bool
    np.testing.assert_array_equal(mask, [[True, True, True, False, False], [True, False, True, False, True]])


def test_padding_mask_custom_pad_id():
    ids = np.where(IDS == 0, 1, IDS + 1)  # pad id 1, and 0 is nowhere
    np.testing.assert_array_equal(to_numpy(padding_mask(ids, pad_id=1)), IDS != 0)
    np.testing.assert_array_equal(to_numpy(padding_mask(ids)), np.ones(IDS.shape, bool))


def test_padding_mask_keeps_any_shape_and_tensor_input():
    ids = keras.ops.convert_to_tensor(IDS[:, None, :])  # (B, 1, T)
    np.testing.assert_array_equal(to_numpy(padding_mask(ids)), IDS[:, None, :] != 0)


@pytest.mark.parametrize("q_len, k_len", [(1, 1), (5, 5), (3, 7), (7, 3), (267, 267)], ids=str)
def test_causal_mask_matches_reference(q_len, k_len):
    mask = to_numpy(causal_mask(q_len, k_len))
    assert mask.dtype == bool and mask.shape == (q_len, k_len)
    np.testing.assert_array_equal(mask, reference.causal_keep(q_len, k_len))


def test_causal_mask_exact_values():
    np.testing.assert_array_equal(to_numpy(causal_mask(3)), np.tril(np.ones((3, 3), bool)))
    np.testing.assert_array_equal(to_numpy(causal_mask(2, 4)), [[1, 1, 1, 0], [1, 1, 1, 1]])  # wide: last 2
    np.testing.assert_array_equal(
        to_numpy(causal_mask(4, 2)), [[0, 0], [0, 0], [1, 0], [1, 1]]  # tall: first 2 rows see nothing
    )


def test_causal_mask_equals_causal_flag(rng):
    q = rng.normal(size=(2, 3, 4, 8)).astype("float32")
    k = rng.normal(size=(2, 3, 6, 8)).astype("float32")
    flag, _ = scaled_dot_product_attention(q, k, k, causal=True)
    given, _ = scaled_dot_product_attention(q, k, k, mask=causal_mask(4, 6))
    np.testing.assert_array_equal(to_numpy(flag), to_numpy(given))


@pytest.mark.parametrize(
    "args, error, message",
    [
        ((0,), ValueError, r"`q_len` must be a positive integer. Received: q_len=0"),
        ((-2,), ValueError, r"`q_len` must be a positive integer. Received: q_len=-2"),
        ((1.5,), TypeError, r"`q_len` must be a positive integer. Received: q_len=1.5"),
        ((True,), TypeError, r"`q_len` must be a positive integer. Received: q_len=True"),
        ((3, 0), ValueError, r"`k_len` must be a positive integer. Received: k_len=0"),
        ((3, 2.0), TypeError, r"`k_len` must be a positive integer. Received: k_len=2.0"),
    ],
    ids=["zero", "negative", "float", "bool", "k_len-zero", "k_len-float"],
)
def test_causal_mask_bad_lengths(args, error, message):
    with pytest.raises(error, match=message):
        causal_mask(*args)


def test_combine_masks_is_logical_and_with_broadcasting():
    pad = IDS != 0  # (B, T)
    combined = to_numpy(combine_masks(pad[:, None, :], causal_mask(5)))
    assert combined.shape == (2, 5, 5)
    np.testing.assert_array_equal(combined, pad[:, None, :] & np.tril(np.ones((5, 5), bool)))


def test_combine_masks_none_handling():
    pad = IDS != 0
    assert combine_masks() is None
    assert combine_masks(None, None) is None
    np.testing.assert_array_equal(to_numpy(combine_masks(None, pad, None)), pad)


def test_combine_masks_accepts_integers_and_refuses_floats():
    np.testing.assert_array_equal(to_numpy(combine_masks(np.array([2, 0, 1]), np.array([True, True, False]))), [1, 0, 0])
    with pytest.raises(MaskDtypeError, match=r"`masks\[1\]` must be a boolean or integer mask.*padding_mask"):
        combine_masks(np.array([True]), np.array([1.0]))


HIDE = np.array([[0, 0, 1], [1, 0, 0]])
KEEP = HIDE == 0


@pytest.mark.parametrize("dtype", ["bool", "int32", "int64", "float32", "float64"])
def test_from_hide_mask_inverts(dtype):
    keep = to_numpy(from_hide_mask(HIDE.astype(dtype)))
    assert keep.dtype == bool
    np.testing.assert_array_equal(keep, KEEP)


def test_from_hide_mask_seed_style_float_tensor():
    # The seeds build (1 - band_part(ones, -1, 0)) and padding masks as float 0.0/1.0 tensors.
    seed_lookahead = 1.0 - np.tril(np.ones((4, 4), "float32"))
    keep = from_hide_mask(keras.ops.convert_to_tensor(seed_lookahead))
    np.testing.assert_array_equal(to_numpy(keep), to_numpy(causal_mask(4)))


@pytest.mark.parametrize("values", [[0.0, 0.5, 1.0], [2.0, 0.0], [-1.0]], ids=["half", "two", "negative"])
def test_from_hide_mask_refuses_fractional_floats(values):
    with pytest.raises(ValueError, match=r"`mask` as a float must hold only 0.0 \(keep\) and 1.0 \(hide\)"):
        from_hide_mask(np.array(values, "float32"))


def test_from_hide_mask_int_nonzero_hides():
    np.testing.assert_array_equal(to_numpy(from_hide_mask(np.array([0, 3, -1]))), [True, False, False])


def test_from_key_padding_mask_is_torch_semantics():
    key_padding_mask = np.array([[False, False, True], [False, True, True]])  # torch: True = ignore
    np.testing.assert_array_equal(to_numpy(from_key_padding_mask(key_padding_mask)), ~key_padding_mask)
    with pytest.raises(ValueError, match=r"`key_padding_mask` as a float must hold only 0.0"):
        from_key_padding_mask(np.array([[0.0, 0.25]]))


@pytest.mark.parametrize("form", ["B,T_k", "B,1,1,T_k"])
def test_from_key_padding_mask_matches_torch_sdpa(rng, form):
    if keras.backend.backend() != "torch":
        pytest.skip("compares with torch.nn.functional.scaled_dot_product_attention, torch backend only")
    import torch
    import torch.nn.functional as F

    q, k, v = (torch.from_numpy(rng.normal(size=(3, 2, t, 8)).astype("float32")) for t in (4, 6, 6))
    key_padding_mask = np.zeros((3, 6), bool)
    key_padding_mask[0, 4:] = key_padding_mask[2, 1:] = True  # (B, T_k), True = ignore
    keep = from_key_padding_mask(key_padding_mask)
    mask = keep if form == "B,T_k" else keep[:, None, None, :]
    # torch.nn.MultiheadAttention turns key_padding_mask into an additive -inf bias the same way.
    bias = torch.zeros(3, 1, 1, 6).masked_fill(torch.from_numpy(key_padding_mask)[:, None, None, :], float("-inf"))
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=bias).numpy()
    np.testing.assert_allclose(to_numpy(fused_attention(q, k, v, mask=mask)), expected, rtol=0, atol=1e-5)
    explicit, _ = scaled_dot_product_attention(q, k, v, mask=mask)
    np.testing.assert_allclose(to_numpy(explicit), expected, rtol=0, atol=1e-5)
