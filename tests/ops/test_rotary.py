"""Rotary position embedding against a float64 NumPy reference (HF rotate-half convention)."""

import numpy as np
import pytest
from keras import ops
from backend_utils import to_numpy
from hypothesis import given, settings
from hypothesis import strategies as st

from attnkit.ops.rotary import apply_rotary, check_rope_scaling, inverse_frequencies, rotary_cos_sin


def reference_rope(x, positions, theta):
    """x (B, h, T, d) float64 rotated: pairs (i, i + d/2) by angle p * theta^(-2i/d)."""
    d = x.shape[-1]
    inv = theta ** (-np.arange(0, d, 2) / d)  # (d/2,)
    angles = positions[:, None, :, None] * inv  # (B, 1, T, d/2)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    c, s = np.cos(angles), np.sin(angles)
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


@pytest.mark.parametrize("theta", [10000.0, 100000.0])
def test_rotary_matches_reference(rng, theta):
    x = rng.standard_normal((2, 3, 5, 8))
    positions = np.array([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])  # a position offset on the second row
    cos, sin = rotary_cos_sin(positions, 8, theta)
    out = to_numpy(apply_rotary(x.astype("float32"), cos, sin))
    np.testing.assert_allclose(out, reference_rope(x, positions.astype("float64"), theta), atol=2e-5)


@settings(max_examples=40, deadline=None)
@given(
    batch=st.integers(0, 3), length=st.integers(0, 6), half=st.integers(1, 8), two_d=st.booleans(),
    largest=st.sampled_from([10, 5000, 2**24 + 3, 2**31 - 1]), theta=st.sampled_from([10000.0, 1e6]), seed=st.integers(0, 2**31 - 1), dtype=st.sampled_from(["float32", "float64"]),
)
def test_host_positions_give_the_tensor_positions_angles_bit_for_bit(batch, length, half, two_d, largest, theta, seed, dtype):
    # A cached call passes NumPy positions, whose angles are taken on the host (item 151): they must be
    # the backend's own, to the bit, including positions past float32's exact integers.
    positions = np.random.default_rng(seed).integers(0, largest, (batch, length) if two_d else (length,))
    host = rotary_cos_sin(positions, 2 * half, theta, dtype)
    tensor = rotary_cos_sin(ops.convert_to_tensor(positions), 2 * half, theta, dtype)
    for a, b in zip(host, tensor):
        assert tuple(a.shape) == tuple(b.shape) == ((batch if two_d else 1), 1, length, 2 * half)
        np.testing.assert_array_equal(to_numpy(a), to_numpy(b))


def test_offset_equals_slice_of_longer_sequence(rng):
    x = rng.standard_normal((1, 2, 6, 4)).astype("float32")
    cos, sin = rotary_cos_sin(np.arange(6), 4)
    full = to_numpy(apply_rotary(x, cos, sin))
    cos3, sin3 = rotary_cos_sin(np.arange(3, 6), 4)
    np.testing.assert_allclose(to_numpy(apply_rotary(x[:, :, 3:], cos3, sin3)), full[:, :, 3:], atol=1e-6)


@settings(max_examples=20, deadline=None)
@given(p=st.integers(0, 500), q=st.integers(0, 500), shift=st.integers(0, 500))
def test_scores_depend_on_relative_position_only(p, q, shift):
    r = np.random.default_rng(p * 1000 + q)
    a, b = r.standard_normal((1, 1, 1, 8)), r.standard_normal((1, 1, 1, 8))

    def score(pa, pb):
        ca, sa = rotary_cos_sin(np.array([pa]), 8, 100.0, dtype="float32")
        cb, sb = rotary_cos_sin(np.array([pb]), 8, 100.0, dtype="float32")
        ra, rb = to_numpy(apply_rotary(a.astype("float32"), ca, sa)), to_numpy(apply_rotary(b.astype("float32"), cb, sb))
        return float((ra * rb).sum())

    assert score(p, q) == pytest.approx(score(p + shift, q + shift), abs=2e-3)


def test_inverse_frequencies_match_transformers_float32():
    torch = pytest.importorskip("torch")
    d, base = 64, 100000.0
    expected = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    # Within two units in the last place: NumPy's and torch's vectorized float32 pow round differently
    # on some CPUs (equal on AVX2 machines; on an AVX-512 EPYC 5 of these 32 values differ, by 1-2 ulp).
    ours = inverse_frequencies(d, base)
    assert ours.dtype == np.float32
    np.testing.assert_array_max_ulp(ours, expected.numpy(), maxulp=2)


def test_refusals():
    with pytest.raises(ValueError, match="yarn"):
        check_rope_scaling({"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="linear"):
        check_rope_scaling({"type": "linear", "factor": 2.0})
    assert check_rope_scaling({"rope_type": "default", "rope_theta": 10000.0}) is None
    with pytest.raises(ValueError, match="`d` must be even"):
        inverse_frequencies(7)
    with pytest.raises(ValueError, match="theta"):
        inverse_frequencies(8, theta=0)
    cos, sin = rotary_cos_sin(np.arange(3), 8)
    with pytest.raises(ValueError, match="width 8"):
        apply_rotary(np.zeros((1, 1, 3, 6), "float32"), cos, sin)
