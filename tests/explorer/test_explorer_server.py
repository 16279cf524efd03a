"""The explorer's server: the page, the JSON endpoint, errors as JSON, the port and the bind address."""

import http.client
import json
import socket
import struct
import threading
import time
import urllib.error
import urllib.request

import pytest

from attnkit.explorer import open_model
from attnkit.explorer.contract import to_json
from attnkit.explorer.server import ExplorerServer
from attnkit.ops import set_max_scores_bytes
from backend_utils import once_per_run

pytestmark = once_per_run  # the page's data contract and its server: the same code whatever the backend (the weights: test_explorer_sources.py)


@pytest.fixture
def serve(tiny_source):
    """Starts servers in threads; stops them after the test."""
    servers = []

    def start(source=tiny_source, **kwargs):
        server = ExplorerServer(source, 0, **kwargs)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def request(url, *, data=None, headers=None):
    """(status, content type, body) of a GET, or of a POST of the JSON `data`."""
    body = None if data is None else (data if isinstance(data, bytes) else json.dumps(data).encode())
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as response:
            return response.status, response.headers["Content-Type"], response.read().decode("utf-8")
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read().decode("utf-8")


def test_the_endpoint_serves_the_data_contract(serve, tiny_source):
    server = serve()
    text = "the cat sat on the mat"
    status, kind, body = request(server.url + "api/attention", data={"text": text})
    assert (status, kind) == (200, "application/json; charset=utf-8")
    assert json.loads(body) == json.loads(to_json(tiny_source.attention(text)))
    status, _, model = request(server.url + "api/model")
    assert status == 200 and json.loads(model) == tiny_source.describe()


def test_the_page_is_served_with_its_endpoint(serve, tiny_source):
    server = serve(text="the dog ran")
    status, kind, page = request(server.url)
    assert (status, kind) == (200, "text/html; charset=utf-8")
    assert '<script type="application/json" id="attnkit-data">null</script>' in page
    config = page.split('id="attnkit-config">', 1)[1].split("</script>", 1)[0]
    assert json.loads(config) == {
        "mode": "served", "model": tiny_source.describe(), "endpoint": "/api/attention", "text": "the dog ran"
    }
    assert "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "").replace(
        'const SVG = "http://www.w3.org/2000/svg"', "")  # no address of another host


@pytest.mark.parametrize(
    "path, data, status, message",
    [
        ("api/attention", {"text": ""}, 400, "The text is empty: type a sentence to see its attention."),
        ("api/attention", {"text": "  "}, 400, "The text is empty"),
        ("api/attention", b"{not json", 400, "The request is not UTF-8 JSON"),
        ("api/attention", {"words": "x"}, 400, 'must be a JSON object {"text": "..."}'),
        ("api/attention", [1, 2], 400, 'must be a JSON object {"text": "..."}'),
        ("api/attention", None, 405, "Use POST /api/attention with Content-Type: application/json"),
        ("nowhere", None, 404, "Not found: /nowhere"),
        ("nowhere", {"text": "x"}, 404, "Not found: /nowhere"),
    ],
)
def test_bad_requests_are_answered_in_json(serve, path, data, status, message):
    server = serve()
    got, kind, body = request(server.url + path, data=data)
    assert (got, kind) == (status, "application/json; charset=utf-8")
    assert message in json.loads(body)["error"]


def test_a_model_failure_is_a_json_500_with_its_message(serve, tiny_bert_dir, capsys):
    server = serve(open_model(tiny_bert_dir))  # a fresh model: jax and tensorflow check the budget as they trace
    set_max_scores_bytes(16)  # the real model refuses to materialise its scores
    try:
        status, kind, body = request(server.url + "api/attention", data={"text": "the cat sat"})
    finally:
        set_max_scores_bytes(None)
    assert (status, kind) == (500, "application/json; charset=utf-8")
    error = json.loads(body)["error"]
    assert error.startswith("The model failed on this text: MemoryError: Explicit attention would allocate")
    assert "\n" not in error
    assert f"attnkit explore: {error}" in capsys.readouterr().err
    assert request(server.url + "api/attention", data={"text": "the cat sat"})[0] == 200  # and it recovers


def test_an_oversized_request_and_a_foreign_host_are_refused(serve):
    server = serve()
    status, _, body = request(server.url + "api/attention", data=b"x", headers={"Content-Length": str(2 << 20)})
    assert status == 413 and "at most 1048576" in json.loads(body)["error"]
    # More digits than int() reads (4300): refused by size, not a failure of the server.
    status, _, body = request(server.url + "api/attention", data=b"x", headers={"Content-Length": "9" * 5000})
    assert status == 413 and json.loads(body)["error"].startswith("The request is a 5000-digit number of bytes")
    status, _, body = request(server.url + "api/attention", data={"text": "x"}, headers={"Host": "evil.example:80"})
    assert status == 403 and "Host 'evil.example:80' refused" in json.loads(body)["error"]


def test_binds_the_loopback_address_only(serve):
    server = serve()
    host, port = server.server_address
    assert (host, server.url) == ("127.0.0.1", f"http://127.0.0.1:{port}/")
    assert port != 0
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        pass
    # 127.0.0.2 is this machine too; a server bound to every address (0.0.0.0) would answer there.
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.2", port), timeout=5).close()


def test_a_busy_port_is_an_error(serve, tiny_source):
    server = serve()
    with pytest.raises(OSError):
        ExplorerServer(tiny_source, server.server_address[1])


def raw_request(server, data):
    """(status, content type, body) of the bytes `data` sent as they are (a Host header is not added)."""
    with socket.create_connection(server.server_address, timeout=10) as sock:
        sock.sendall(data)
        response = http.client.HTTPResponse(sock)
        response.begin()
        return response.status, response.headers["Content-Type"], response.read().decode("utf-8")


def test_a_lone_surrogate_is_a_json_400_for_every_model(serve, tiny_source, translator_source):
    # JSON's \ud800 escape decodes to a string UTF-8 cannot encode: no tokenizer takes it, and the
    # translator's answer, which repeats the text, could not be sent.
    for source in (tiny_source, translator_source):
        server = serve(source)
        status, kind, body = request(server.url + "api/attention", data=b'{"text": "ab\\ud800cd"}')
        assert (status, kind) == (400, "application/json; charset=utf-8")
        assert json.loads(body)["error"] == "The text is not valid Unicode: a lone surrogate \\ud800 at offset 2"


@pytest.mark.parametrize("length", ["-1", "-5", "ten", "1_0"])
def test_a_content_length_that_is_not_a_count_is_a_400(serve, length):
    server = serve()
    port = server.server_address[1]
    status, kind, body = raw_request(
        server,
        f"POST /api/attention HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n".encode()
        + b'{"text": "x"}',  # the client keeps its connection open: reading to its end would wait forever
    )
    assert (status, kind) == (400, "application/json; charset=utf-8")
    assert json.loads(body)["error"] == f"Content-Length must be a non-negative integer. Received: {length!r}"


@pytest.mark.parametrize(
    "line, status, message",
    [
        (b"GET /api/model?text=" + b"a" * 65536 + b" HTTP/1.1", 414, "over 65536 bytes"),
        (b"GARBAGE", 400, "Bad request syntax ('GARBAGE')"),
        (b"GET /api/model HTTP/one", 400, "Bad request version ('HTTP/one')"),
        (b"PUT /api/attention HTTP/1.1", 501, "Unsupported method ('PUT')"),
    ],
)
def test_the_http_servers_own_errors_are_json(serve, line, status, message):
    server = serve()
    got, kind, body = raw_request(server, line + f"\r\nHost: 127.0.0.1:{server.server_address[1]}\r\n\r\n".encode())
    assert (got, kind) == (status, "application/json; charset=utf-8")
    assert message in json.loads(body)["error"]


def test_a_request_left_unfinished_frees_its_thread_after_the_timeout(serve, capsys, monkeypatch):
    """A body shorter than its Content-Length, the connection kept open: the handler's thread waited
    for the rest for ever; after `timeout` seconds it closes the connection, silently."""
    from attnkit.explorer import server as server_module

    monkeypatch.setattr(server_module._Handler, "timeout", 0.5)
    server = serve()
    port = server.server_address[1]
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(f"POST /api/attention HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: 100\r\n\r\n{{".encode())
        assert sock.recv(1024) == b""  # closed by the server, well within the client's 10 s
    assert request(server.url + "api/model")[0] == 200
    assert capsys.readouterr().err == ""


def test_a_client_that_goes_away_leaves_no_traceback(serve, capsys):
    server = serve()
    port = server.server_address[1]
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    # Half a body, then a reset (SO_LINGER 0): the server's read fails with ConnectionResetError.
    sock.sendall(f"POST /api/attention HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: 100\r\n\r\n{{".encode())
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()
    time.sleep(1)  # the handler's thread meets the reset
    assert request(server.url + "api/model")[0] == 200  # still serving
    assert capsys.readouterr().err == ""
