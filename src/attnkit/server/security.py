"""The checks every request passes before a route sees it, as ASGI middleware (docs/decisions.md item 118).

- Host: only the server's own names (127.0.0.1, localhost, [::1], the bound address, each with the
  port the request came to), 403 otherwise: a web page reaching the server through DNS rebinding
  sends its own name, as the explorer refuses it (`attnkit.explorer.server`). With an API key any Host
  is served: such a page cannot send the key, and clients elsewhere name a machine bound to 0.0.0.0 by
  addresses and DNS names the server cannot list (all were 403, so `--host 0.0.0.0 --api-key K`
  answered no one but this machine).
- Origin: a browser's cross-origin request (an Origin other than http://<an allowed Host>) is 403; no
  CORS header is ever sent, so no page elsewhere may read an answer.
- Authorization: with an API key, every path but /health needs `Authorization: Bearer <key>`
  (401 otherwise), compared with `hmac.compare_digest` (constant time).
- Body size: a Content-Length over the limit is 413 at once; a chunked body is counted as it comes.
"""

import hmac
import json


class BodyTooLarge(Exception):
    """A chunked body grew past the limit (the route answers 413)."""


def _error(status, message, code, kind="invalid_request_error", headers=()):
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]
    return status, headers, body


class Guard:
    """Wraps an ASGI app with the checks above.

    Args:
        app: the ASGI app.
        host: the address the server binds.
        api_key: the key, or None (no authorization).
        max_body: the most bytes a request body may hold.
    """

    def __init__(self, app, *, host, api_key=None, max_body=1 << 20):
        self.app, self.api_key, self.max_body = app, api_key, max_body
        self.names = {"127.0.0.1", "localhost", "[::1]", f"[{host}]" if ":" in host else host}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refusal = self._refusal(scope)
        if refusal is not None:
            status, headers, body = refusal
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        limit, seen = self.max_body, 0

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(f"The request body is over {limit} bytes")
            return message

        await self.app(scope, counted, send)

    def _refusal(self, scope):
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        for name in ("host", "origin"):  # host names are case-insensitive: LOCALHOST:8000 was 403
            if name in headers:
                headers[name] = headers[name].lower()
        port = scope.get("server", (None, None))[1]
        allowed = {f"{name}:{port}" for name in self.names}
        host = headers.get("host")
        if host not in allowed and self.api_key is None:
            return _error(403, f"Host {host!r} refused: this server answers to {sorted(allowed)} (DNS rebinding; "
                          "with an API key, --api-key, it answers to any name)", "host_refused")
        origin = headers.get("origin")
        if origin is not None and origin not in {f"http://{name}" for name in allowed}:
            return _error(403, f"Origin {origin!r} refused: cross-origin requests are not served", "origin_refused")
        if self.api_key is not None and scope["path"] != "/health":
            given = headers.get("authorization", "")
            scheme, _, token = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
                return _error(401, "Missing or wrong API key: send `Authorization: Bearer <key>`", "invalid_api_key",
                              headers=[(b"www-authenticate", b"Bearer")])
        length = headers.get("content-length")
        if length is not None:
            if not (length.isascii() and length.isdigit()):
                return _error(400, f"Content-Length must be a non-negative integer. Received: {length!r}", "invalid_content_length")
            if len(length.lstrip("0")) > 12 or int(length) > self.max_body:
                return _error(413, f"The request body is {length[:20]} bytes; this server takes at most {self.max_body}", "body_too_large")
        return None
