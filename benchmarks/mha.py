"""MultiHeadAttention forward+backward, B=32, T=128, d_model=512, h=8, float32, torch backend.

Anchors, measured in the same process: torch.nn.MultiheadAttention and keras.layers.MultiHeadAttention.
Run: KERAS_BACKEND=torch python benchmarks/mha.py
"""

import os
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")
sys.path.insert(0, os.path.dirname(__file__))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import attnkit  # noqa: E402
from timing import markdown_table, median_seconds  # noqa: E402

B, T, D, H = 32, 128, 512, 8


def forward_backward(step):
    def run():
        out = step()
        out.sum().backward()

    return run


def main():
    torch.manual_seed(0)
    x = torch.from_numpy(np.random.default_rng(0).normal(size=(B, T, D)).astype("float32")).requires_grad_(True)

    ours = attnkit.MultiHeadAttention(H, D // H, D // H, D)
    theirs_keras = keras.layers.MultiHeadAttention(num_heads=H, key_dim=D // H)
    theirs_torch = torch.nn.MultiheadAttention(D, H, batch_first=True)
    ours(x), theirs_keras(x, x)

    rows = []
    t_ours = median_seconds(forward_backward(lambda: ours(x)))
    t_torch = median_seconds(forward_backward(lambda: theirs_torch(x, x, x, need_weights=False)[0]))
    t_keras = median_seconds(forward_backward(lambda: theirs_keras(x, x)))
    rows.append(["attnkit MultiHeadAttention", f"{t_ours * 1e3:.1f}", "1.00"])
    rows.append(["torch.nn.MultiheadAttention", f"{t_torch * 1e3:.1f}", f"{t_torch / t_ours:.2f}"])
    rows.append(["keras.layers.MultiHeadAttention", f"{t_keras * 1e3:.1f}", f"{t_keras / t_ours:.2f}"])
    print(f"MultiHeadAttention forward+backward, B={B}, T={T}, d_model={D}, h={H}, float32, "
          f"{torch.get_num_threads()} threads")
    print(markdown_table(["implementation", "median ms", "speed-up of attnkit (their time / ours)"], rows))


if __name__ == "__main__":
    main()
