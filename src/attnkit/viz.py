"""Attention heatmaps: what each head attends to, tokens on the axes.

Needs matplotlib (the `viz` extra). Uses the non-interactive Agg backend when none is chosen (no
matplotlib.use, MPLBACKEND or matplotlibrc backend, pyplot not imported yet), so it works on machines
without a screen; a backend the user chose is kept.

Figures stay at most MAX_INCHES a side (MAX_INCHES * 110 pixels when saved): long sequences get
smaller cells and fewer, smaller tick labels rather than an image of tens of thousands of pixels.

Legend: h heads, T_q query tokens (rows), T_k key tokens (columns).
"""

import math
import numbers
import sys

import numpy as np

MAX_INCHES = 40.0  # the longest side of a figure
DPI = 110  # of saved figures
CELL = 0.28  # inches per token when it fits: labels stay readable
LABEL_POINTS = 7  # tick label font size at full cell size
MIN_LABEL_POINTS = 4  # below this, only every k-th token is labelled


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


def _choose_backend():
    """Agg unless the user chose a backend: matplotlib.use, MPLBACKEND, a matplotlibrc, or pyplot already
    running with one (rcParams then holds the resolved name instead of the "auto" sentinel)."""
    import matplotlib

    chosen = matplotlib.rcParams._get_backend_or_none() if hasattr(matplotlib.rcParams, "_get_backend_or_none") else None
    if chosen is None and "matplotlib.pyplot" not in sys.modules:
        matplotlib.use("Agg")


def _layout(h, t_q, t_k, cols):
    """(rows, cols, cell inches, label font size, label step) for panels fitting within MAX_INCHES."""
    cols = max(1, min(cols, h))
    rows = math.ceil(h / cols)
    # each panel has ~1.2 x 1.0 inches of axes, labels and colorbar around its cells
    cell = min(CELL, (MAX_INCHES / cols - 1.2) / t_k, (MAX_INCHES / rows - 1.0) / t_q)
    if cell * DPI < 1:  # less than a pixel per token
        raise ValueError(
            f"{h} heads of {t_q} x {t_k} tokens do not fit in a {MAX_INCHES:g}-inch figure with at least one pixel "
            f"per token (cols={cols}); plot fewer heads or a shorter sequence. Received: weights.shape={(h, t_q, t_k)}"
        )
    points = min(LABEL_POINTS, cell * 72 * 0.9)  # a label fits in its cell
    step = max(1, math.ceil(MIN_LABEL_POINTS / points)) if points < MIN_LABEL_POINTS else 1
    return rows, cols, cell, max(points, MIN_LABEL_POINTS), step


def plot_attention(weights, x_tokens=None, y_tokens=None, *, title=None, head_names=None, cols=4, path=None):
    """Draws one heatmap panel per head.

    Args:
        weights: (T_q, T_k) or (h, T_q, T_k) attention weights (NumPy or any backend tensor), with
            h, T_q, T_k >= 1.
        x_tokens: the T_k key tokens, drawn along the x axis; default their indices.
        y_tokens: the T_q query tokens, drawn along the y axis; default `x_tokens` when T_q == T_k.
        title: figure title.
        head_names: h panel titles; default "head 0", "head 1", ...
        cols: panels per row, a positive integer. Default 4.
        path: if given, the figure is saved there (PNG by the file's extension) and closed.

    Returns:
        The matplotlib `Figure` (None once saved to `path` and closed). It is at most MAX_INCHES
        (40) inches a side: long sequences get smaller cells, and every k-th token labelled.

    Raises:
        ValueError: weights of another rank or with an empty dimension, token lists or head_names of
            the wrong length, cols < 1, more heads and tokens than a figure can show.
        TypeError: cols not an integer.

    Example:
    >>> _, w = attnkit.MultiHeadAttention(4, 8, 8, 32)(x, return_attention_weights=True)
    >>> plot_attention(w[0], tokens, tokens, path="heads.png")
    """
    heads = _as_heads(weights)
    h, t_q, t_k = heads.shape
    if min(heads.shape) == 0:
        raise ValueError(
            f"`weights` must have at least one head, one query and one key. Received: weights.shape={(h, t_q, t_k)}"
        )
    x_tokens = _check_tokens("x_tokens", x_tokens, t_k)
    if y_tokens is None and t_q == t_k:
        y_tokens = x_tokens
    y_tokens = _check_tokens("y_tokens", y_tokens, t_q)
    if head_names is None:
        head_names = [f"head {i}" for i in range(h)]
    head_names = [str(name) for name in head_names]
    if len(head_names) != h:
        raise ValueError(f"`head_names` must have {h} entries, one per head. Received: {len(head_names)} names")
    if isinstance(cols, bool) or not isinstance(cols, numbers.Integral):
        raise TypeError(f"`cols` must be a positive integer. Received: cols={cols!r} of type {type(cols).__name__}")
    if cols < 1:
        raise ValueError(f"`cols` must be a positive integer. Received: cols={cols}")
    rows, cols, cell, points, step = _layout(h, t_q, t_k, int(cols))

    _choose_backend()
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        rows, cols, squeeze=False,
        figsize=(max(3.0, cols * (1.2 + cell * t_k)), max(2.5, rows * (1.0 + cell * t_q))),
    )
    try:
        for i, ax in enumerate(axes.flat):
            if i >= h:
                ax.axis("off")
                continue
            image = ax.imshow(heads[i], cmap="viridis", vmin=0.0, vmax=max(1e-9, float(heads[i].max())), aspect="auto")
            # parse_math=False: every label is drawn as written; "$x$" would be typeset and "$$" refused
            ax.set_title(head_names[i], fontsize=9, parse_math=False)
            ax.set_xticks(range(0, t_k, step), x_tokens[::step], rotation=90, fontsize=points, parse_math=False)
            ax.set_yticks(range(0, t_q, step), y_tokens[::step], fontsize=points, parse_math=False)
            fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
        if title:
            fig.suptitle(title, parse_math=False)
        fig.tight_layout()
        if path is not None:
            fig.savefig(path, dpi=DPI)
    except BaseException:
        plt.close(fig)
        raise
    if path is not None:
        plt.close(fig)
        return None
    return fig
