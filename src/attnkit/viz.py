"""Attention heatmaps: what each head attends to, tokens on the axes.

Needs matplotlib (the `viz` extra). Uses the non-interactive Agg backend when none is chosen, so it
works on machines without a screen.

Legend: h heads, T_q query tokens (rows), T_k key tokens (columns).
"""

import math

import numpy as np


def _as_heads(weights):
    """Any weights array as NumPy (h, T_q, T_k)."""
    try:
        from keras import ops

        weights = ops.convert_to_numpy(weights)
    except Exception:  # already NumPy, or not a tensor Keras knows
        pass
    weights = np.asarray(weights, dtype=np.float32)
    if weights.ndim == 2:
        return weights[None]  # (1, T_q, T_k)
    if weights.ndim == 3:
        return weights
    raise ValueError(
        "`weights` must have shape (T_q, T_k) or (h, T_q, T_k); select one sequence of a batch first "
        f"(e.g. weights[0]). Received: weights.shape={weights.shape}"
    )


def _check_tokens(name, tokens, size):
    if tokens is None:
        return [str(i) for i in range(size)]
    tokens = [str(t) for t in tokens]
    if len(tokens) != size:
        raise ValueError(f"`{name}` must have {size} entries to match the weights. Received: {len(tokens)} tokens")
    return tokens


def plot_attention(weights, x_tokens=None, y_tokens=None, *, title=None, head_names=None, cols=4, path=None):
    """Draws one heatmap panel per head.

    Args:
        weights: (T_q, T_k) or (h, T_q, T_k) attention weights (NumPy or any backend tensor).
        x_tokens: the T_k key tokens, drawn along the x axis; default their indices.
        y_tokens: the T_q query tokens, drawn along the y axis; default `x_tokens` when T_q == T_k.
        title: figure title.
        head_names: one title per panel; default "head 0", "head 1", ...
        cols: panels per row. Default 4.
        path: if given, the figure is saved there (PNG by the file's extension) and closed.

    Returns:
        The matplotlib `Figure` (None once saved to `path` and closed).

    Raises:
        ValueError: weights of another rank, token lists of the wrong length.

    Example:
    >>> _, w = attnkit.MultiHeadAttention(4, 8, 8, 32)(x, return_attention_weights=True)
    >>> plot_attention(w[0], tokens, tokens, path="heads.png")
    """
    import matplotlib

    if matplotlib.get_backend().lower() not in ("agg", "pdf", "svg", "ps", "cairo"):
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heads = _as_heads(weights)
    h, t_q, t_k = heads.shape
    x_tokens = _check_tokens("x_tokens", x_tokens, t_k)
    if y_tokens is None and t_q == t_k:
        y_tokens = x_tokens
    y_tokens = _check_tokens("y_tokens", y_tokens, t_q)
    head_names = head_names or [f"head {i}" for i in range(h)]

    cols = max(1, min(int(cols), h))
    rows = math.ceil(h / cols)
    cell = 0.28  # inches per token, so labels stay readable
    fig, axes = plt.subplots(
        rows, cols, squeeze=False,
        figsize=(max(3.0, cols * (1.2 + cell * t_k)), max(2.5, rows * (1.0 + cell * t_q))),
    )
    for i, ax in enumerate(axes.flat):
        if i >= h:
            ax.axis("off")
            continue
        image = ax.imshow(heads[i], cmap="viridis", vmin=0.0, vmax=max(1e-9, float(heads[i].max())), aspect="auto")
        ax.set_title(head_names[i], fontsize=9)
        ax.set_xticks(range(t_k), x_tokens, rotation=90, fontsize=7)
        ax.set_yticks(range(t_q), y_tokens, fontsize=7)
        fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return None
    return fig
