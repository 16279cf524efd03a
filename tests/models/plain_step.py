"""The check that torch's plain decoding step (`models._torch_decoding`) computes what the layers compute."""

import numpy as np
from backend_utils import to_numpy


def assert_plain_step_equals_layers(model, monkeypatch):
    """A prefill and three steps through `_torch_decoding.forward` equal the layers' own calls bit for
    bit (logits and cache), and the plain step ran each time."""
    from attnkit.models import _torch_decoding

    ids = np.array([[0, 0, 3, 4, 5, 6, 7, 8], [9, 8, 7, 6, 5, 4, 3, 2]], "int32")
    mask = np.array([[0, 0, 1, 1, 1, 1, 1, 1], [1] * 8])
    plain = _torch_decoding.forward

    def decode(forward):
        monkeypatch.setattr(_torch_decoding, "forward", forward)
        cache = model.new_cache(2, 11)
        steps = [model(ids[:, :5], attention_mask=mask[:, :5], cache=cache)]
        steps += [model(ids[:, t : t + 1], attention_mask=mask[:, t : t + 1], cache=cache) for t in range(5, 8)]
        return [to_numpy(s) for s in steps], [to_numpy(k) for k in cache.keys + cache.values]

    ran = []
    (ours, our_cache) = decode(lambda *args: ran.append(plain(*args)) or ran[-1])
    (layers, layer_cache) = decode(lambda *args: None)  # None: the caller runs the layers
    assert len(ran) == 4 and all(r is not None for r in ran)  # the plain step ran, not the layers for it
    for a, b in zip(ours + our_cache, layers + layer_cache):
        np.testing.assert_array_equal(a, b)
