"""`attnkit.viz.plot_attention`: argument checks, the figure size cap, the backend it leaves chosen.

Figures are drawn on NumPy weights (the backend tensors go through keras.ops.convert_to_numpy, as
in the CLI tests); nothing here is backend-specific.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

matplotlib = pytest.importorskip("matplotlib")

from attnkit import viz  # noqa: E402
from backend_utils import once_per_run  # noqa: E402


def weights(h, t_q, t_k):
    w = np.random.default_rng(0).random((h, t_q, t_k)).astype(np.float32)
    return w / w.sum(axis=-1, keepdims=True)


@pytest.fixture(autouse=True)
def _no_open_figures():
    import matplotlib.pyplot as plt

    plt.close("all")
    yield
    assert plt.get_fignums() == [], "plot_attention left a figure open"


def test_small_figure_keeps_readable_cells():
    import matplotlib.pyplot as plt

    fig = viz.plot_attention(weights(2, 3, 4), ["a", "b", "c", "d"], ["x", "y", "z"], head_names=["one", "two"])
    width, height = fig.get_size_inches()
    assert width == pytest.approx(2 * (1.2 + 0.28 * 4)) and height == pytest.approx(2.5)
    first = fig.axes[0]
    assert [t.get_text() for t in first.get_xticklabels()] == ["a", "b", "c", "d"]
    assert first.get_title() == "one"
    plt.close(fig)


def test_long_sequences_are_capped_at_max_inches():
    import matplotlib.pyplot as plt

    # `heads` on a 300-word sentence: 12 heads of 302 tokens drew a 291 x 218-inch (32067 px) figure
    fig = viz.plot_attention(weights(12, 302, 302))
    width, height = fig.get_size_inches()
    assert width == pytest.approx(viz.MAX_INCHES) and height <= viz.MAX_INCHES
    labels = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    step = int(labels[1]) - int(labels[0])
    assert step > 1 and labels[:2] == ["0", str(step)] and len(labels) == -(-302 // step)  # every k-th token
    assert min(t.get_fontsize() for t in fig.axes[0].get_xticklabels()) == viz.MIN_LABEL_POINTS
    plt.close(fig)


def test_too_many_heads_for_one_figure_is_refused():
    with pytest.raises(ValueError, match=r"400 heads of 50 x 50 tokens do not fit in a 40-inch figure"):
        viz.plot_attention(weights(400, 50, 50), cols=1)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"head_names": ["only one"]}, ValueError, r"`head_names` must have 2 entries, one per head. Received: 1 names"),
        ({"cols": "x"}, TypeError, r"`cols` must be a positive integer. Received: cols='x' of type str"),
        ({"cols": 2.5}, TypeError, r"`cols` must be a positive integer. Received: cols=2.5 of type float"),
        ({"cols": 0}, ValueError, r"`cols` must be a positive integer. Received: cols=0"),
        ({"x_tokens": ["a"]}, ValueError, r"`x_tokens` must have 3 entries to match the weights. Received: 1 tokens"),
    ],
)
def test_bad_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        viz.plot_attention(weights(2, 3, 3), **kwargs)


@pytest.mark.parametrize("shape", [(0, 3, 3), (2, 0, 3), (2, 3, 0), (0, 0)])
def test_empty_weights_are_refused(shape):
    with pytest.raises(ValueError, match=r"`weights` must have at least one head, one query and one key"):
        viz.plot_attention(np.zeros(shape, dtype=np.float32))


def test_the_figure_is_closed_when_saving_fails(tmp_path):
    with pytest.raises(OSError):
        viz.plot_attention(weights(1, 2, 2), path=str(tmp_path / "no-such-dir" / "x.png"))
    # the autouse fixture asserts that no figure is left open


PLOT = "from attnkit.viz import plot_attention; plot_attention(np.ones((2, 2), 'float32') / 2); "


@once_per_run
@pytest.mark.parametrize("choice, expected", [("matplotlib.use('template'); ", "template"), ("", "agg")])
def test_the_backend_is_agg_only_when_the_user_chose_none(choice, expected):
    # A fresh process each: pyplot's backend cannot go back once a figure exists in this one.
    code = f"import matplotlib, numpy as np; {choice}{PLOT}print(matplotlib.get_backend().lower())"
    env = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.stdout.strip() == expected, result.stderr[-2000:]


def test_labels_are_drawn_as_written_never_as_math(tmp_path):
    """Tokens such as "$$" or "$x$" were handed to matplotlib's mathtext: "$$" failed to draw with an
    empty first line of error, "$x$" was typeset as an italic x."""
    import matplotlib.pyplot as plt

    tokens = ["Pay", "$$", "$x$", "\\frac"]
    options = dict(head_names=["$h$"], title="costs $5 or $6")
    viz.plot_attention(weights(1, 4, 4), tokens, path=tmp_path / "w.png", **options)  # drawn: "$$" fails to draw as math
    assert (tmp_path / "w.png").stat().st_size > 0
    fig = viz.plot_attention(weights(1, 4, 4), tokens, **options)
    ax = fig.axes[0]
    labels = ax.get_xticklabels() + ax.get_yticklabels() + [ax.title, fig._suptitle]
    assert [t.get_text() for t in ax.get_xticklabels()] == tokens
    assert all(not t.get_parse_math() for t in labels)
    plt.close(fig)
