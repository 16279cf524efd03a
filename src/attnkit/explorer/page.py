"""The explorer page: page.html with its configuration and data inlined.

The page is one file: its script and style are inline, it draws with SVG and canvas, and its
Content-Security-Policy allows no request but the same origin's endpoint, so an exported page
works offline from disk and a served one talks only to its own server.
"""

import re
from importlib import resources

from attnkit.explorer.contract import to_script_json

_CONFIG, _DATA = "__ATTNKIT_CONFIG__", "__ATTNKIT_DATA__"
_MARKERS = re.compile(f"{_CONFIG}|{_DATA}")


def _template():
    return resources.files("attnkit.explorer").joinpath("page.html").read_text(encoding="utf-8")


def render_page(model, *, data=None, endpoint=None, text=None):
    """The page's HTML.

    Args:
        model: the source's `describe()` dict, for the header.
        data: the data contract to show (exported pages); None when served.
        endpoint: the JSON endpoint's path (served pages); None when exported.
        text: a text the served page explores as it opens, or None.

    Returns:
        The HTML text.

    Raises:
        ValueError: neither or both of `data` and `endpoint`.
    """
    if (data is None) == (endpoint is None):
        raise ValueError("render_page needs either `data` (an exported page) or `endpoint` (a served one)")
    config = {"mode": "export" if data is not None else "served", "model": model, "endpoint": endpoint, "text": text}
    values = {_CONFIG: to_script_json(config), _DATA: to_script_json(data) if data is not None else "null"}
    # One pass over the template, whose only markers are its two elements': the text put in is never
    # searched again, so a text, token or model name spelling a marker stays text.
    return _MARKERS.sub(lambda marker: values[marker.group(0)], _template())
