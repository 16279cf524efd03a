"""What the explorer's server accepts before it reads a model or computes (docs/decisions.md item 110).

A web page the user visits can make the browser send requests to 127.0.0.1: an `<img src>` GET, a form
or a "no-cors" `fetch` POST with a text/plain body. The page cannot read the answer, but the server
would load the model and compute for it (a denial of service from any tab). Browsers say where a
request comes from, and these checks refuse every request another site made:

- `Origin` (sent by browsers with every POST and every cross-origin `fetch`): if present it must be
  this server's own (`http://127.0.0.1:PORT` or `http://localhost:PORT`); "null" (a sandboxed frame,
  a file:// page) is refused too;
- `Sec-Fetch-Site` (sent by today's browsers with every request): "same-origin" or "none" (the user
  typed the address, or `--open` opened it); "same-site" (another port of 127.0.0.1) and "cross-site"
  are refused;
- the computing endpoint takes only POST with `Content-Type: application/json`, a type no form and no
  "no-cors" request can send (they are limited to text/plain, form types): a cross-site page cannot
  reach it without a CORS preflight, which this server never answers with permission.

Clients that are not browsers (curl, Python) send neither header and pass, as they should.
"""

import json

JSON_TYPE = "application/json"
_SITES = ("same-origin", "none")


def foreign_origin(headers, port):
    """The reason a request from another web page is refused, or None for the server's own page."""
    own = (f"http://127.0.0.1:{port}", f"http://localhost:{port}")
    origin = headers.get("Origin")
    if origin is not None and origin not in own:
        return f"Origin {origin!r} refused: the explorer answers its own page only (http://127.0.0.1:{port}/)"
    site = headers.get("Sec-Fetch-Site")
    if site is not None and site.strip().lower() not in _SITES:
        return f"Sec-Fetch-Site {site!r} refused: the explorer answers its own page only (http://127.0.0.1:{port}/)"
    return None


def not_json_type(headers):
    """The reason a POST body is refused for its Content-Type, or None for application/json."""
    value = headers.get("Content-Type")
    if value is None:
        return f"The request needs Content-Type: {JSON_TYPE}"
    if value.split(";", 1)[0].strip().lower() != JSON_TYPE:
        return f"The request's Content-Type must be {JSON_TYPE}. Received: {value!r}"
    return None


def parse_json_body(raw):
    """The JSON value of a request body (bytes), or raises ValueError with a message for the client.

    Refused, as RFC 8259 JSON is: bytes that are not UTF-8, NaN / Infinity / -Infinity (Python's
    extension), numbers too large for a double or over Python's 4300 digits, duplicate keys (which of
    two "text" values would be meant?), and nesting too deep to parse (a RecursionError inside the
    parser, which would otherwise escape the handler and drop the connection).
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"The request is not UTF-8 JSON: {e}") from None
    try:
        return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float,
                          object_pairs_hook=_unique_keys)
    except RecursionError:
        raise ValueError("The request is not UTF-8 JSON: it is nested too deeply to parse") from None
    except ValueError as e:  # json.JSONDecodeError, and int()'s digit limit
        raise ValueError(f"The request is not UTF-8 JSON: {e}") from None


def _refuse_constant(name):
    raise ValueError(f"{name} is not a JSON value")


def _finite_float(literal):
    value = float(literal)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"the number {literal[:40]}{'...' if len(literal) > 40 else ''} is too large for a double")
    return value


def _unique_keys(pairs):
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"the key {key!r} appears twice in one object")
        seen[key] = value
    return seen
