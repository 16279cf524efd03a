"""Running the app with uvicorn: in the CLI's main thread (signals stop it gracefully) or in a thread
of its own (the tests, on port 0).

SIGTERM or Ctrl-C: no new request is taken (the engine refuses with 503, uvicorn stops accepting
connections), the requests in flight finish for up to `drain` seconds, then the server ends and the
process exits 0 (docs/decisions.md item 119). A second signal ends it at once.
"""

import contextlib
import signal
import threading

import uvicorn


class Server(uvicorn.Server):
    """A uvicorn server of `app` that closes `engine` as it stops.

    Args:
        app: the ASGI app (`create_app`).
        engine: its `Engine`.
        host, port: where to listen; port 0 picks a free one (`port` says which once `started`).
        drain: seconds in-flight requests get to finish after a stop signal.
        state: the app's state (its `closing` flag is raised at the stop).
    """

    def __init__(self, app, engine, *, host="127.0.0.1", port=0, drain=30.0, state=None):
        super().__init__(uvicorn.Config(
            app, host=host, port=port, log_level="warning", access_log=False, lifespan="off",
            timeout_graceful_shutdown=drain, timeout_keep_alive=5,
        ))
        self.engine, self.drain, self.state = engine, drain, state

    @property
    def port(self):
        return self.servers[0].sockets[0].getsockname()[1]

    def handle_exit(self, sig, frame):
        if self.state is not None:
            self.state.closing = True
        with self.engine.condition:
            self.engine.closing = True  # new requests: 503 (the running ones go on)
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        """uvicorn's own handlers re-raise the signal after the shutdown (exit status 130 or 143): these stop
        the server and let it end normally."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        saved = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in saved.items():
                signal.signal(sig, handler)

    def serve_and_close(self):
        """Serves until stopped; then lets the engine finish what it holds (bounded) and stops it."""
        try:
            self.run()
        finally:
            self.engine.close(timeout=self.drain)


@contextlib.contextmanager
def serving_in_thread(app, engine, state=None, **options):
    """Starts `Server(app, engine, **options)` in a thread; yields it once it listens; stops it after."""
    server = Server(app, engine, state=state, **options)
    thread = threading.Thread(target=server.serve_and_close, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("The server stopped before it started")
        thread.join(0.01)
    try:
        yield server
    finally:
        server.should_exit = True
        thread.join(60)
