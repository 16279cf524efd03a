"""`attnkit serve` as a process: it prints its URL, serves, and on SIGTERM refuses new requests, lets
the one in flight finish, and exits 0."""

import json
import os
import signal
import subprocess
import sys
import threading

import keras
import pytest

pytest.importorskip("fastapi", reason="the server's stack (attnkit[serve])")

from attnkit.cli.serve import warn_if_open  # noqa: E402
from test_api import raw  # noqa: E402

from backend_utils import once_per_run  # noqa: E402

# The process's URL, SIGTERM handling and exit do not depend on the backend (the API is tested per
# backend in test_api.py).
pytestmark = once_per_run

SRC = os.path.join(os.path.dirname(__file__), "..", "..", "src")


@pytest.mark.skipif(keras.backend.backend() != "torch", reason="the process's life is the backend's-independent part; "
                    "tests/server/test_api.py serves on this backend in-process")
def test_sigterm_finishes_the_request_in_flight_and_exits_0(tiny_llama_path, tiny_bert_path):
    env = {**os.environ, "PYTHONPATH": os.path.abspath(SRC), "ATTNKIT_API_KEY": "k"}
    process = subprocess.Popen(
        [sys.executable, "-m", "attnkit.cli", "serve", "--model", tiny_llama_path, "--embedding-model", tiny_bert_path,
         "--port", "0", "--max-batch", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        lines = []
        for line in process.stderr:
            lines.append(line)
            if "attnkit serve: http://" in line:
                break
        assert lines, process.communicate(timeout=60)
        port = int(lines[-1].split("http://127.0.0.1:")[1].split("/")[0])
        auth = {"Authorization": "Bearer k"}
        body = json.dumps({"model": os.path.basename(tiny_llama_path), "prompt": "x", "max_tokens": 40, "temperature": 0})
        result = {}
        slow = threading.Thread(target=lambda: result.update(r=raw(port, "POST", "/v1/completions", body, auth)))
        slow.start()
        while json.loads(raw(port, "GET", "/health")[2]).get("busy", 0) == 0:
            pass
        process.send_signal(signal.SIGTERM)
        slow.join(120)
        status, _, answer = result["r"]
        assert status == 200 and json.loads(answer)["usage"]["completion_tokens"] == 40, answer  # finished, not cut
        assert process.wait(60) == 0
        rest = process.stderr.read()
        assert "attnkit serve: stopped" in rest and "Traceback" not in rest
    finally:
        if process.poll() is None:
            process.kill()


def test_a_non_loopback_address_without_a_key_warns(capsys):
    warn_if_open("0.0.0.0", None)
    assert "without an API key" in capsys.readouterr().err
    for host, key in (("127.0.0.1", None), ("::1", None), ("localhost", None), ("0.0.0.0", "k")):
        warn_if_open(host, key)
        assert capsys.readouterr().err == ""
