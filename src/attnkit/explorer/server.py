"""The explorer's local server: the page at `/`, the data contract at `/api/attention`.

    GET  /                          the page
    GET  /api/model                 the source's `describe()`
    POST /api/attention {"text": t}  the data contract of t (Content-Type: application/json)

Every answer of the API is JSON; an error is {"error": message} with status 400 (bad input:
empty text, a body the JSON parser cannot take, text that is not UTF-8, a bad Content-Length, a
malformed request line), 403 (a Host header other than this server's, or a request another web page
made: `request_checks`), 404, 405 (a GET of the computing endpoint), 411, 413 (a request over 1 MiB),
414 (a request line over 64 KiB), 415 (a POST that is not application/json), 501 (a method other than
GET and POST) or 500 (the model failed; the message says why). It binds 127.0.0.1 only
(docs/decisions.md items 38 and 110).
"""

import http.server
import sys
import threading
from urllib.parse import urlsplit

from attnkit._messages import one_line, original
from attnkit.explorer.contract import to_json
from attnkit.explorer.page import render_page
from attnkit.explorer.request_checks import foreign_origin, not_json_type, parse_json_body
from attnkit.explorer.sources.checks import BadInput, check_text

HOST = "127.0.0.1"
ENDPOINT = "/api/attention"
MAX_BODY = 1 << 20  # bytes


# The messages of http.server's refusals that it gives none (its own are HTML-page titles).
_ERRORS = {414: "The request line is over 65536 bytes: send long text as POST /api/attention {\"text\": ...}"}


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

    def handle_error(self, request, client_address):
        """A client gone mid-request (a closed tab, a cancelled fetch) is not the server's error: no
        traceback for it in the terminal; any other error is printed as socketserver prints it."""
        if not isinstance(sys.exc_info()[1], ConnectionError):  # BrokenPipeError, ConnectionResetError, ...
            super().handle_error(request, client_address)


class _Handler(http.server.BaseHTTPRequestHandler):
    server_version = "attnkit-explorer"
    timeout = 60  # seconds a client may leave a request unfinished (a short body) before its thread lets go

    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        pass  # the terminal shows the URL and errors, not every request (a timed-out one neither)

    def send_error(self, code, message=None, explain=None):
        """http.server's own refusals (414, a malformed request line, 501 ...) in the API's JSON, not HTML."""
        if self.request_version == self.default_request_version:
            # A request line too malformed to give its version: answered with a status line and headers,
            # which HTTP/0.9 would leave out and every client today needs.
            self.request_version = "HTTP/1.0"
        self.close_connection = True
        self._json(code, {"error": message or _ERRORS.get(code) or self.responses.get(code, ("Error",))[0]})

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
            # A GET is what an <img>, a <script> or a link of any web page can send without the page's
            # own origin: the computing endpoint takes only JSON POSTs (docs/decisions.md item 110).
            self._json(405, {"error": 'Use POST /api/attention with Content-Type: application/json and {"text": "..."}'},
                       headers={"Allow": "POST"})
        else:
            self._json(404, {"error": f"Not found: {parts.path}"})

    def do_POST(self):  # noqa: N802 - http.server's name
        if not self._host_ok():
            return
        if urlsplit(self.path).path != ENDPOINT:
            self._json(404, {"error": f"Not found: {urlsplit(self.path).path}"})
            return
        refused = not_json_type(self.headers)
        if refused:
            self.close_connection = True  # the body is left unread
            self._json(415, {"error": refused})
            return
        length = self._content_length()
        if length is None:
            return
        try:
            body = parse_json_body(self.rfile.read(length))
        except ValueError as e:
            self._json(400, {"error": str(e)})
            return
        if not isinstance(body, dict) or not isinstance(body.get("text"), str):
            self._json(400, {"error": 'The request must be a JSON object {"text": "..."} with a string text'})
            return
        self._attention(body["text"])

    def _content_length(self):
        """The body's length in bytes, or None once a 411, 400 or 413 is sent: a negative length would
        make `rfile.read` wait for the client to close its connection."""
        value = self.headers.get("Content-Length")
        if value is None:
            self._json(411, {"error": "The request needs a Content-Length"})
            return None
        if not (value.isascii() and value.isdigit()):  # HTTP's 1*DIGIT: int() also takes -1, +1 and 1_0
            self._json(400, {"error": f"Content-Length must be a non-negative integer. Received: {value!r}"})
            return None
        digits = value.lstrip("0") or "0"
        if len(digits) > len(str(MAX_BODY)) or int(digits) > MAX_BODY:  # int() refuses over 4300 digits
            size = digits if len(digits) <= 20 else f"a {len(digits)}-digit number of"
            self._json(413, {"error": f"The request is {size} bytes; the explorer takes at most {MAX_BODY}"})
            return None
        return int(digits)

    def _attention(self, text):
        try:
            check_text(text)  # here too, for any source: text UTF-8 cannot encode could not be answered
            data = self.server.attention(text)
        except BadInput as e:
            self._json(400, {"error": str(e)})
        except Exception as e:  # noqa: BLE001 - the page shows every failure as a message
            # The CLI's reduction: tensorflow's StagingError unwrapped, Keras's wrapped message to its line.
            e = original(e)
            message = f"The model failed on this text: {type(e).__name__}: {one_line(e)}"
            print(f"attnkit explore: {message}", file=sys.stderr)  # one line in the terminal too
            self._json(500, {"error": message})
        else:
            self._send(200, to_json(data).encode("utf-8"), "application/json; charset=utf-8")

    def _host_ok(self):
        """Refuses a Host other than this server's (a web page reaching it through DNS rebinding), and a
        request another web page made (`request_checks.foreign_origin`), before anything is computed."""
        port = self.server.server_address[1]
        if self.headers.get("Host") not in (f"{HOST}:{port}", f"localhost:{port}"):
            self._json(403, {"error": f"Host {self.headers.get('Host')!r} refused: open {self.server.url}"})
            return False
        refused = foreign_origin(self.headers, port)
        if refused:
            self.close_connection = True  # a POST's body is left unread
            self._json(403, {"error": refused})
            return False
        return True

    def _json(self, status, value, headers=None):
        self._send(status, to_json(value).encode("utf-8"), "application/json; charset=utf-8", headers)

    def _send(self, status, body, content_type, headers=None):
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.end_headers()
        self.wfile.write(body)
