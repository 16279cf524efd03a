"""The explorer's local server: the page at `/`, the data contract at `/api/attention`.

    GET  /                          the page
    GET  /api/model                 the source's `describe()`
    POST /api/attention {"text": t}  the data contract of t (GET /api/attention?text=t too)

Every answer of the API is JSON; an error is {"error": message} with status 400 (bad input:
empty text, bad JSON), 403 (a Host header other than this server's), 404, 413 (a request over
1 MiB) or 500 (the model failed; the message says why). It binds 127.0.0.1 only
(docs/decisions.md item 38).
"""

import http.server
import json
import sys
import threading
from urllib.parse import parse_qs, urlsplit

from attnkit.explorer.contract import to_json
from attnkit.explorer.page import render_page
from attnkit.explorer.sources import BadInput

HOST = "127.0.0.1"
ENDPOINT = "/api/attention"
MAX_BODY = 1 << 20  # bytes


class ExplorerServer(http.server.ThreadingHTTPServer):
    """Serves one source's page and endpoint on 127.0.0.1.

    Args:
        source: an explorer source (`attnkit.explorer.open_model`).
        port: the port; 0 (default) lets the system pick a free one (`url` says which).
        text: a text the page explores as it opens, or None.

    Raises:
        OSError: the port is in use or cannot be bound.
    """

    daemon_threads = True  # a browser's idle keep-alive connection must not hold up Ctrl-C

    def __init__(self, source, port=0, *, text=None):
        self.source, self.text = source, text
        self.lock = threading.Lock()  # one model call at a time: Keras models are not thread-safe
        super().__init__((HOST, port), _Handler)

    @property
    def url(self):
        return f"http://{HOST}:{self.server_address[1]}/"

    def attention(self, text):
        with self.lock:
            return self.source.attention(text)


class _Handler(http.server.BaseHTTPRequestHandler):
    server_version = "attnkit-explorer"

    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        pass  # the terminal shows the URL and errors, not every request

    def do_GET(self):  # noqa: N802 - http.server's name
        if not self._host_ok():
            return
        parts = urlsplit(self.path)
        if parts.path == "/":
            page = render_page(self.server.source.describe(), endpoint=ENDPOINT, text=self.server.text)
            self._send(200, page.encode("utf-8"), "text/html; charset=utf-8")
        elif parts.path == "/api/model":
            self._json(200, self.server.source.describe())
        elif parts.path == ENDPOINT:
            texts = parse_qs(parts.query, keep_blank_values=True).get("text")
            if texts is None:
                self._json(400, {"error": "Give the text: GET /api/attention?text=... or POST {\"text\": ...}"})
            else:
                self._attention(texts[0])
        else:
            self._json(404, {"error": f"Not found: {parts.path}"})

    def do_POST(self):  # noqa: N802 - http.server's name
        if not self._host_ok():
            return
        if urlsplit(self.path).path != ENDPOINT:
            self._json(404, {"error": f"Not found: {urlsplit(self.path).path}"})
            return
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            self._json(411, {"error": "The request needs a Content-Length"})
            return
        if length > MAX_BODY:
            self._json(413, {"error": f"The request is {length} bytes; the explorer takes at most {MAX_BODY}"})
            return
        try:
            body = json.loads(self.rfile.read(length).decode("utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            self._json(400, {"error": f"The request is not UTF-8 JSON: {e}"})
            return
        if not isinstance(body, dict) or not isinstance(body.get("text"), str):
            self._json(400, {"error": 'The request must be a JSON object {"text": "..."} with a string text'})
            return
        self._attention(body["text"])

    def _attention(self, text):
        try:
            data = self.server.attention(text)
        except BadInput as e:
            self._json(400, {"error": str(e)})
        except Exception as e:  # noqa: BLE001 - the page shows every failure as a message
            # The CLI's reduction: tensorflow's StagingError unwrapped, Keras's wrapped message to its line.
            from attnkit.cli import _original, one_line

            e = _original(e)
            message = f"The model failed on this text: {type(e).__name__}: {one_line(e)}"
            print(f"attnkit explore: {message}", file=sys.stderr)  # one line in the terminal too
            self._json(500, {"error": message})
        else:
            self._send(200, to_json(data).encode("utf-8"), "application/json; charset=utf-8")

    def _host_ok(self):
        """Refuses a Host other than this server's (a web page reaching it through DNS rebinding)."""
        port = self.server.server_address[1]
        if self.headers.get("Host") in (f"{HOST}:{port}", f"localhost:{port}"):
            return True
        self._json(403, {"error": f"Host {self.headers.get('Host')!r} refused: open {self.server.url}"})
        return False

    def _json(self, status, value):
        self._send(status, to_json(value).encode("utf-8"), "application/json; charset=utf-8")

    def _send(self, status, body, content_type):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.end_headers()
        self.wfile.write(body)
