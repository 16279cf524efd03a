"""The data contract: shapes, rounding, refusals, and JSON that is safe inside a <script> element."""

import html.parser
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from attnkit.explorer.contract import Attention, Steps, make_data, to_json, to_script_json
from attnkit.explorer.page import render_page
from backend_utils import once_per_run

pytestmark = once_per_run  # the page's data contract and its server: the same code whatever the backend (the weights: test_explorer_sources.py)


def make(**kwargs):
    return make_data(model="m", source="s", text="t", tokens=["t"], **kwargs)


def softmax_rows(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def data_for(weights, tokens=None, **kwargs):
    n, h, T_q, T_k = weights.shape
    queries = tokens or [f"q{i}" for i in range(T_q)]
    keys = tokens or [f"k{i}" for i in range(T_k)]
    return make(attention=[Attention("self", queries, keys, weights)], **kwargs)


@settings(max_examples=40, deadline=None)
@given(
    hnp.arrays(np.float32, hnp.array_shapes(min_dims=4, max_dims=4, max_side=5),
               elements=st.floats(-30, 30, width=32)),
    st.integers(1, 8),
)
def test_weights_round_to_the_stated_decimals(scores, decimals):
    weights = softmax_rows(scores.astype(np.float64)).astype(np.float32)
    data = json.loads(to_json(data_for(weights, decimals=decimals)))
    assert data["decimals"] == decimals and data["max_error"] == 0.5 * 10.0 ** -decimals
    got = np.array(data["attention"][0]["weights"])
    assert got.shape == weights.shape
    assert np.abs(got - weights.astype(np.float64)).max() <= data["max_error"] + 1e-12
    np.testing.assert_array_equal(got, np.round(got, decimals))  # no more digits than stated


def test_the_contract_names_everything_the_page_needs():
    weights = softmax_rows(np.random.default_rng(0).standard_normal((2, 3, 4, 4)))
    data = data_for(weights, tokens=["a", "b", "c", "d"], notes=["truncated"])
    assert data["format"] == "attnkit-attention" and data["version"] == 1
    assert (data["model"], data["source"], data["text"], data["notes"]) == ("m", "s", "t", ["truncated"])
    kind = data["attention"][0]
    assert (kind["layers"], kind["heads"], kind["query_tokens"]) == (2, 3, ["a", "b", "c", "d"])
    assert "4 decimal places" in data["rounding"] and data["steps"] is None


@pytest.mark.parametrize(
    "weights, message",
    [
        (np.zeros((2, 4, 4)), r"must be \(n, h, T_q, T_k\)"),
        (np.zeros((1, 1, 3, 4)), r"Received: shape \(1, 1, 3, 4\)"),
        (np.full((1, 1, 4, 4), np.nan), "contain 16 NaN or infinite values"),
        (np.full((1, 1, 4, 4), 1.5), r"must lie in \[0, 1\]"),
        (np.full((1, 1, 4, 4), -0.1), r"must lie in \[0, 1\]"),
    ],
)
def test_wrong_weights_are_refused(weights, message):
    with pytest.raises(ValueError, match=message):
        make(attention=[Attention("self", list("abcd"), list("abcd"), weights)])


def test_steps_must_fit_a_stepwise_attention():
    w = np.full((1, 1, 3, 3), 1 / 3)
    causal = Attention("self", list("abc"), list("abc"), w, stepwise=True, causal=True)
    data = make(attention=[causal], steps=Steps(["x", "y", "z"], [1, 2, 3]))
    assert data["steps"] == {"labels": ["x", "y", "z"], "query_rows": [1, 2, 3]}
    with pytest.raises(ValueError, match="non-decreasing, from 1 to the stepwise attentions' 3 rows"):
        make(attention=[causal], steps=Steps(["x", "y"], [2, 4]))
    with pytest.raises(ValueError, match="one label and one query_rows entry per step"):
        make(attention=[causal], steps=Steps(["x"], [1, 2]))
    plain = Attention("self", list("abc"), list("abc"), w)
    with pytest.raises(ValueError, match="no attention is stepwise"):
        make(attention=[plain], steps=Steps(["x"], [1]))
    with pytest.raises(ValueError, match="different query and key tokens"):
        make(attention=[Attention("x", list("abc"), list("abd"), w, causal=True)])
    with pytest.raises(ValueError, match="`decimals` must be an integer from 1 to 8"):
        make(attention=[plain], decimals=0)


def test_kv_heads_name_each_query_heads_shared_key_value_head():
    w = np.full((1, 4, 2, 2), 0.5)
    assert make(attention=[Attention("self", list("ab"), list("ab"), w)])["attention"][0]["kv_heads"] is None
    grouped = make(attention=[Attention("self", list("ab"), list("ab"), w, kv_heads=[0, 0, 1, 1])])
    assert grouped["attention"][0]["kv_heads"] == [0, 0, 1, 1]
    for bad in ([0, 1], [0, 0, 1, -1]):
        with pytest.raises(ValueError, match=r"`kv_heads` of 'self' must give a key/value head index >= 0 for each of its 4"):
            make(attention=[Attention("self", list("ab"), list("ab"), w, kv_heads=bad)])


class _Scripts(html.parser.HTMLParser):
    """The text of each <script> element by id, as a browser's parser splits it."""

    def __init__(self):
        super().__init__()
        self.scripts, self._id = {}, None

    def handle_starttag(self, tag, attrs):
        if tag == "script":
            self._id = dict(attrs).get("id")
            self.scripts[self._id] = ""

    def handle_endtag(self, tag):
        if tag == "script":
            self._id = None

    def handle_data(self, data):
        if self._id is not None:
            self.scripts[self._id] += data


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=4), st.text(max_size=20))
def test_any_token_survives_the_page_unchanged(tokens, text):
    """Tokens such as "</script>" or "<!--" can neither end the data element nor change the numbers."""
    T = len(tokens)
    weights = np.full((1, 1, T, T), 1.0 / T)
    data = make_data(model="</script><script>alert(1)</script>", source="s", text=text, tokens=tokens,
                     attention=[Attention("self", tokens, tokens, weights)])
    page = render_page({"model": "<!--", "source": "s"}, data=data)
    parser = _Scripts()
    parser.feed(page)
    assert json.loads(parser.scripts["attnkit-data"]) == json.loads(to_json(data))
    assert json.loads(parser.scripts["attnkit-config"])["model"] == {"model": "<!--", "source": "s"}
    assert "<" not in to_script_json(data)


@pytest.mark.parametrize("name", ["__ATTNKIT_DATA__", "__ATTNKIT_CONFIG__"])
def test_a_text_spelling_the_pages_markers_stays_text(name):
    """The served page's text (`--text`) and an exported page's model name are in the config, written
    before the data: a config holding the data's marker took the data's place (invalid JSON, a blank page)."""
    data = data_for(np.full((1, 1, 2, 2), 0.5), tokens=[name, "b"])
    for page, config in [
        (render_page({"model": name, "source": "s"}, data=data), {"mode": "export", "text": None, "endpoint": None}),
        (render_page({"model": "m", "source": "s"}, endpoint="/api", text=name), {"mode": "served", "text": name}),
    ]:
        parser = _Scripts()
        parser.feed(page)
        got = json.loads(parser.scripts["attnkit-config"])
        assert {key: got[key] for key in config} == config
        assert json.loads(parser.scripts["attnkit-data"]) == (json.loads(to_json(data)) if config["mode"] == "export" else None)


def test_a_lone_surrogate_is_refused_naming_where_it_is():
    """A lone surrogate (JSON's "\\ud800") in a custom source's tokens reached `export_page`, which failed
    writing the file with a UnicodeEncodeError."""
    w = np.full((1, 1, 2, 2), 0.5)
    with pytest.raises(ValueError, match=r"`tokens`\[1\] is not valid Unicode: a lone surrogate \\ud800 at offset 1"):
        make_data(model="m", source="s", text="t", tokens=["a", "b\ud800"], attention=[Attention("self", ["a", "b"], ["a", "b"], w)])
    with pytest.raises(ValueError, match=r"The query_tokens of 'self'\[1\] is not valid Unicode"):
        data_for(w, tokens=["a", "b\ud800"])
    with pytest.raises(ValueError, match=r"The key_tokens of 'self'\[0\] is not valid Unicode: a lone surrogate \\udfff"):
        make(attention=[Attention("self", ["a", "b"], ["\udfff", "c"], w)])
    with pytest.raises(ValueError, match=r"`steps.labels`\[0\] is not valid Unicode"):
        make(attention=[Attention("self", ["a", "b"], ["a", "b"], w, stepwise=True)], steps=Steps(["\ud83d"], [1]))
    with pytest.raises(ValueError, match=r"`output` is not valid Unicode"):
        data_for(w, output="\ud83d")
    kind = data_for(w, tokens=["\U0001f431", "e\u0301"], output="\U0001f431")["attention"][0]
    assert kind["query_tokens"] == ["\U0001f431", "e\u0301"]


def test_decimals_may_be_a_numpy_integer():
    data = data_for(np.full((1, 1, 2, 2), 0.5), decimals=np.int64(3))
    assert data["decimals"] == 3 and type(data["decimals"]) is int and "3 decimal places" in data["rounding"]
    json.loads(to_json(data))
