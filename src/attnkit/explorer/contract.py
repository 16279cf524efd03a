"""The explorer's data contract: the JSON a page carries in `<script id="attnkit-data">` and the
server's `/api/attention` returns.

    {
      "format": "attnkit-attention", "version": 1,
      "model": "all-MiniLM-L6-v2", "source": "pretrained-encoder", "text": "The cat sat.",
      "tokens": ["[CLS]", "the", "cat", "sat", ".", "[SEP]"],       # the input as the model reads it
      "decimals": 4, "max_error": 5e-05,
      "rounding": "every weight is the model's float32 weight rounded to 4 decimal places ...",
      "notes": ["The text is 300 tokens long ..."],
      "attention": [
        {"name": "self-attention", "query_tokens": [...], "key_tokens": [...],
         "stepwise": false, "causal": false, "kv_heads": null,
         "weights": [[[[w, ...], ...], ...], ...]}          # layers x heads x T_q x T_k
      ],
      "steps": null | {"labels": [...], "query_rows": [...]},
      "output": null | "2021-03-03"
    }

`steps` (models that generate): at step s the page shows the query rows [0, query_rows[s]) of every
`stepwise` attention, and `labels[s]` is the token generated at that step; a `causal` attention has
its keys equal to its queries and shows the same number of keys.

`kv_heads` (grouped-query attention): for each of the h query heads, the key/value head it shares;
null when every head has its own keys and values.

Legend: n layers, h heads, T_q query tokens, T_k key tokens.
"""

import json
from dataclasses import dataclass, field

import numpy as np

FORMAT, VERSION = "attnkit-attention", 1
DEFAULT_DECIMALS = 4


@dataclass
class Attention:
    """One kind of attention of a model over one input.

    Attributes:
        name: what the page calls it ("self-attention", "cross-attention", ...).
        query_tokens: the T_q token strings of the rows.
        key_tokens: the T_k token strings of the columns.
        weights: (n, h, T_q, T_k) weights, rows are queries.
        stepwise: whether the rows appear one decoding step at a time (see `Steps`).
        causal: whether the keys are the queries (decoder self-attention): a step shows as many keys
            as rows.
        kv_heads: None, or for each of the h query heads the key/value head it shares
            (grouped-query attention).
    """

    name: str
    query_tokens: list
    key_tokens: list
    weights: np.ndarray
    stepwise: bool = False
    causal: bool = False
    kv_heads: list = None


@dataclass
class Steps:
    """The decoding steps of a generating model.

    Attributes:
        labels: the token generated at each step.
        query_rows: at step s, the stepwise attentions' rows [0, query_rows[s]) exist.
    """

    labels: list
    query_rows: list = field(default_factory=list)


def rounding_text(decimals):
    return (
        f"every weight is the model's float32 weight rounded to {decimals} decimal places (half to even), "
        f"so it differs from it by at most {0.5 * 10.0 ** -decimals:g}"
    )


def make_data(*, model, source, text, tokens, attention, steps=None, notes=(), output=None,
              decimals=DEFAULT_DECIMALS):
    """Builds the contract's JSON object (a dict of plain Python values).

    Args:
        model: the model's name.
        source: the kind of model ("pretrained-encoder", "date-translator", ...).
        text: the input text, as typed.
        tokens: the input's tokens as the model reads them (after truncation).
        attention: a non-empty list of `Attention`.
        steps: a `Steps` for generating models, else None.
        notes: strings the page shows above the views (truncation, ...).
        output: the generated text of a generating model, else None.
        decimals: the weights' decimal places, 1 to 8. Default 4.

    Returns:
        A dict, ready for `json.dumps`.

    Raises:
        ValueError: weights that are not (n, h, T_q, T_k) matching the tokens, that are not finite or
            lie outside [0, 1] (beyond float32 rounding), steps that do not fit the attentions, bad
            `decimals`, or a string with a lone surrogate (no UTF-8 page or answer can hold it).
    """
    if isinstance(decimals, bool) or not isinstance(decimals, (int, np.integer)) or not 1 <= decimals <= 8:
        raise ValueError(f"`decimals` must be an integer from 1 to 8. Received: decimals={decimals!r}")
    decimals = int(decimals)  # a NumPy integer is not JSON
    if not attention:
        raise ValueError("`attention` must list at least one Attention. Received: an empty list")
    kinds = [_attention_json(a, decimals) for a in attention]
    steps_json = None
    if steps is not None:
        steps_json = _steps_json(steps, attention)
    return {
        "format": FORMAT,
        "version": VERSION,
        "model": _text(model, "`model`"),
        "source": _text(source, "`source`"),
        "text": _text(text, "`text`"),
        "tokens": _texts(tokens, "`tokens`"),
        "decimals": decimals,
        "max_error": 0.5 * 10.0 ** -decimals,
        "rounding": rounding_text(decimals),
        "notes": _texts(notes, "`notes`"),
        "attention": kinds,
        "steps": steps_json,
        "output": None if output is None else _text(output, "`output`"),
    }


def _text(value, what):
    """`value` as a str; a lone surrogate (JSON's "\\ud800") is refused: no UTF-8 page or answer holds it."""
    text = str(value)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{what} is not valid Unicode: a lone surrogate \\u{ord(text[e.start]):04x} at offset {e.start}"
        ) from None
    return text


def _texts(values, what):
    return [_text(value, f"{what}[{i}]") for i, value in enumerate(values)]


def _attention_json(a, decimals):
    w = np.asarray(a.weights)
    T_q, T_k = len(a.query_tokens), len(a.key_tokens)
    if w.ndim != 4 or w.shape[2:] != (T_q, T_k) or w.shape[0] == 0 or w.shape[1] == 0:
        raise ValueError(
            f"The weights of {a.name!r} must be (n, h, T_q, T_k) = (n, h, {T_q}, {T_k}) for its "
            f"{T_q} query and {T_k} key tokens. Received: shape {w.shape}"
        )
    if not np.isfinite(w).all():
        raise ValueError(f"The weights of {a.name!r} contain {int((~np.isfinite(w)).sum())} NaN or infinite values")
    w = w.astype(np.float64)
    slack = 1e-6  # float32 softmax sums may pass 1 by an ulp or so
    if w.size and (w.min() < -slack or w.max() > 1 + slack):
        raise ValueError(
            f"The weights of {a.name!r} must lie in [0, 1]. Received: values from {w.min()} to {w.max()}"
        )
    if a.causal and list(a.query_tokens) != list(a.key_tokens):
        raise ValueError(f"A causal attention has its queries as keys; {a.name!r} has different query and key tokens")
    kv_heads = None if a.kv_heads is None else [int(g) for g in a.kv_heads]
    if kv_heads is not None and (len(kv_heads) != w.shape[1] or min(kv_heads) < 0):
        raise ValueError(
            f"`kv_heads` of {a.name!r} must give a key/value head index >= 0 for each of its {w.shape[1]} query "
            f"heads. Received: {kv_heads}"
        )
    rounded = np.clip(np.round(w, decimals), 0.0, 1.0)  # (n, h, T_q, T_k)
    return {
        "name": _text(a.name, "An attention's name"),
        "query_tokens": _texts(a.query_tokens, f"The query_tokens of {a.name!r}"),
        "key_tokens": _texts(a.key_tokens, f"The key_tokens of {a.name!r}"),
        "stepwise": bool(a.stepwise),
        "causal": bool(a.causal),
        "kv_heads": kv_heads,
        "layers": int(w.shape[0]),
        "heads": int(w.shape[1]),
        "weights": rounded.tolist(),
    }


def _steps_json(steps, attention):
    labels, rows = _texts(steps.labels, "`steps.labels`"), [int(r) for r in steps.query_rows]
    if len(labels) != len(rows) or not labels:
        raise ValueError(
            f"`steps` needs one label and one query_rows entry per step. Received: {len(labels)} labels, "
            f"{len(rows)} query_rows"
        )
    stepwise = [a for a in attention if a.stepwise]
    if not stepwise:
        raise ValueError("`steps` given, but no attention is stepwise")
    T_q = min(len(a.query_tokens) for a in stepwise)
    if any(r < 1 for r in rows) or any(b < a for a, b in zip(rows, rows[1:])) or rows[-1] > T_q:
        raise ValueError(
            f"`steps.query_rows` must be non-decreasing, from 1 to the stepwise attentions' {T_q} rows. "
            f"Received: {rows}"
        )
    return {"labels": labels, "query_rows": rows}


def to_json(data):
    """The contract (or any JSON value) as JSON text (UTF-8 kept), as the endpoint sends it."""
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def to_script_json(data):
    """The contract (or any JSON value) as JSON safe inside an HTML `<script>` element.

    "<", ">" and "&" only occur inside JSON strings, where their \\u escapes mean the same: no token
    can close the element ("</script>") or open a comment ("<!--").
    """
    return to_json(data).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def weights_array(kind):
    """One attention kind of a contract (a parsed dict) back as a float64 (n, h, T_q, T_k) array."""
    return np.array(kind["weights"], dtype=np.float64)
