"""The explorer computes for its own page only, and takes any request body without failing
(docs/decisions.md item 110): requests another web page can make are refused before the
model is called, and bodies the JSON parser cannot take are a JSON 400, the server serving on."""

import http.client
import json
import socket
import threading

import pytest
from test_explorer_server import request

from attnkit.explorer.server import ExplorerServer
from backend_utils import once_per_run

pytestmark = once_per_run  # the page's data contract and its server: the same code whatever the backend (the weights: test_explorer_sources.py)


class CountingSource:
    """The tiny model's source, counting the texts it computes."""

    def __init__(self, source):
        self.source, self.calls = source, 0

    def __getattr__(self, name):
        return getattr(self.source, name)

    def attention(self, text):
        self.calls += 1
        return self.source.attention(text)


@pytest.fixture(scope="module")
def server(tiny_source):
    server = ExplorerServer(CountingSource(tiny_source), 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def _raw(server, method, headers, body=b""):
    """(status, content type, body) of a request sent with exactly these headers (a first computation
    compiles the model: jax under load takes seconds)."""
    port = server.server_address[1]
    lines = [f"{method} /api/attention HTTP/1.1", f"Host: 127.0.0.1:{port}", f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    with socket.create_connection(server.server_address, timeout=120) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
        response = http.client.HTTPResponse(sock)
        response.begin()
        return response.status, response.headers["Content-Type"], response.read().decode("utf-8")


@pytest.mark.parametrize(
    "method, headers, status, message",
    [
        # <img src=http://127.0.0.1:PORT/api/attention?text=...> on any site: no Origin, cross-site
        ("GET", {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Dest": "image"}, 403, "Sec-Fetch-Site 'cross-site' refused"),
        # the same from a page on another port of this machine: same-site, not same-origin
        ("GET", {"Sec-Fetch-Site": "same-site"}, 403, "Sec-Fetch-Site 'same-site' refused"),
        # a GET without browser headers (an old browser's <img>): the endpoint computes on POSTs only
        ("GET", {}, 405, "Use POST /api/attention"),
        # fetch(url, {mode: "no-cors", method: "POST", body}) from another site: text/plain, an Origin
        ("POST", {"Origin": "https://evil.example", "Content-Type": "text/plain;charset=UTF-8"}, 403,
         "Origin 'https://evil.example' refused"),
        ("POST", {"Origin": "null", "Content-Type": "application/json"}, 403, "Origin 'null' refused"),
        ("POST", {"Origin": "http://127.0.0.1:1", "Content-Type": "application/json"}, 403,
         "Origin 'http://127.0.0.1:1' refused"),
        ("POST", {"Origin": "http://localhost.evil.example", "Content-Type": "application/json"}, 403, "refused"),
        # a <form method=post> or a no-cors POST whose Origin was stripped by a proxy
        ("POST", {"Content-Type": "text/plain"}, 415, "Content-Type must be application/json. Received: 'text/plain'"),
        ("POST", {"Content-Type": "application/x-www-form-urlencoded"}, 415, "must be application/json"),
        ("POST", {"Content-Type": "multipart/form-data; boundary=x"}, 415, "must be application/json"),
        ("POST", {"Content-Type": "application/jsonp"}, 415, "must be application/json"),
        ("POST", {}, 415, "The request needs Content-Type: application/json"),
    ],
)
def test_requests_another_page_can_make_are_refused_before_any_computation(server, method, headers, status, message):
    before = server.source.calls
    got, kind, body = _raw(server, method, headers, b'{"text": "the cat"}' if method == "POST" else b"")
    assert (got, kind) == (status, "application/json; charset=utf-8")
    assert message in json.loads(body)["error"]
    assert server.source.calls == before


def test_the_page_itself_is_answered(server):
    """What the served page's fetch sends: its own origin, same-origin, application/json (any charset)."""
    port = server.server_address[1]
    for origin in (f"http://127.0.0.1:{port}", f"http://localhost:{port}"):
        headers = {"Origin": origin, "Sec-Fetch-Site": "same-origin", "Content-Type": "Application/JSON; charset=utf-8"}
        status, _, body = _raw(server, "POST", headers, b'{"text": "the cat"}')
        assert status == 200 and json.loads(body)["attention"]
    # a typed address (Sec-Fetch-Site: none) gets the page
    assert request(server.url, headers={"Sec-Fetch-Site": "none"})[0] == 200


def _nested(depth):
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize(
    "body, message",
    [
        (b'{"text": ' + _nested(100_000) + b"}", "nested too deeply to parse"),
        (b'{"text": "x", "deep": ' + b'{"a": ' * 50_000 + b"1" + b"}" * 50_001, "nested too deeply to parse"),
        (_nested(3_000), "nested too deeply to parse"),  # past the recursion limit, far below the size limit
        (b'{"text": "caf\xe9"}', "not UTF-8 JSON: 'utf-8' codec can't decode byte 0xe9"),
        (b'{"text": "x", "n": ' + b"7" * 5000 + b"}", "Exceeds the limit (4300 digits)"),
        (b'{"text": "x", "n": 1e400}', "the number 1e400 is too large for a double"),
        (b'{"text": "x", "n": -1e400}', "the number -1e400 is too large for a double"),
        (b'{"text": "x", "n": NaN}', "NaN is not a JSON value"),
        (b'{"text": "x", "n": [Infinity]}', "Infinity is not a JSON value"),
        (b'{"text": "x", "n": -Infinity}', "-Infinity is not a JSON value"),
        (b'{"text": "a", "text": "b"}', "the key 'text' appears twice in one object"),
        (b'{"text": "x", "o": {"k": 1, "k": 2}}', "the key 'k' appears twice"),
        (b"\xef\xbb\xbf{\"text\": \"x\"}", "not UTF-8 JSON"),  # a BOM is not JSON (RFC 8259 8.1)
    ],
)
def test_a_body_the_parser_cannot_take_is_a_json_400_and_the_server_serves_on(server, body, message):
    before = server.source.calls
    status, kind, answer = _raw(server, "POST", {"Content-Type": "application/json"}, body)
    assert (status, kind) == (400, "application/json; charset=utf-8")
    error = json.loads(answer)["error"]
    assert error.startswith("The request is not UTF-8 JSON: ") and message in error, error
    assert server.source.calls == before
    status, _, answer = request(server.url + "api/attention", data={"text": "the cat"})
    assert status == 200 and server.source.calls == before + 1
