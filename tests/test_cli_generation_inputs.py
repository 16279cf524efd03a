"""`attnkit generate` and `attnkit chat` as a user meets them (docs/decisions.md items 107 and 108): the
text printed is the text generated, to its last character, control characters escaped; a reply that
is empty, sampling options that greedy decoding ignores and a byte-order mark are said or dropped;
Ctrl-C during a chat's reply stops that reply only. On a tiny random llama."""

import io
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import unicodedata

import pytest
from tiny_lm import save_tiny_llama

pytest.importorskip("torch")
pytest.importorskip("transformers")

from attnkit.cli import main  # noqa: E402
from attnkit._messages import terminal_text  # noqa: E402
from attnkit.pipelines.causal_checkpoint import load_causal_lm  # noqa: E402

from backend_utils import once_per_run  # noqa: E402

# What the commands print and how Ctrl-C ends a reply do not depend on the backend (generation is
# tested per backend in tests/models).
pytestmark = once_per_run


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny") / "lm")


@pytest.fixture(scope="module")
def lm(model_dir):
    return load_causal_lm(model_dir)


def _raw_controls(text):
    return [c for c in text if unicodedata.category(c) == "Cc" and c not in "\n\t"]


def test_generate_prints_the_generated_text_to_its_last_character_with_controls_escaped(model_dir, lm, capsys):
    """It printed one character less than `lm.generate` when the last token ended inside a character,
    and the model's ESC, BEL, CR raw."""
    seen = set()
    for seed in range(16):
        text = lm.generate("hi", max_new_tokens=4, temperature=50.0, seed=seed)
        assert main(["generate", "hi", "--model", model_dir, "--max-new-tokens", "4", "--temperature", "50", "--seed", str(seed)]) == 0
        out = capsys.readouterr().out
        assert out == terminal_text(text) + "\n" and not _raw_controls(out)
        seen |= {"ends inside a character"} if text.endswith("\ufffd") else set()
        seen |= {"control characters"} if _raw_controls(text) else set()
        if len(seen) == 2:
            break
    assert seen == {"ends inside a character", "control characters"}  # both cases came up


def test_terminal_text_escapes_controls_but_keeps_lines_and_tabs():
    assert terminal_text("a\x1b[2Jb\r\x07\x00\x7f\x85\n\tc\\") == "a\\x1b[2Jb\\x0d\\x07\\x00\\x7f\\x85\n\tc\\"


def test_an_empty_generation_is_said_on_stderr_and_points_at_chat(tmp_path, capsys):
    # every logit 0: greedy picks id 0, the end-of-sequence token, first (an instruct model on a raw question)
    path = save_tiny_llama(tmp_path / "ends", eos_token_id=0, zero_norm=True)
    capsys.readouterr()  # transformers' progress bar
    assert main(["generate", "What is 12 plus 7?", "--model", path]) == 0
    captured = capsys.readouterr()
    assert captured.out == "\n"
    assert captured.err == ("attnkit: note: the model generated no text for this prompt: an instruct model answers chat "
                            "messages, not raw text: try `attnkit chat`, or --chat-template\n")
    assert main(["generate", "What is 12 plus 7?", "--model", path, "--chat-template"]) == 0
    assert capsys.readouterr().err == "attnkit: note: the model generated no text for this prompt\n"


def test_sampling_options_on_a_greedy_model_are_named_on_stderr(model_dir, capsys):
    assert main(["generate", "hi", "--model", model_dir, "--max-new-tokens", "4"]) == 0
    greedy = capsys.readouterr().out
    assert main(["generate", "hi", "--model", model_dir, "--max-new-tokens", "4", "--top-k", "5", "--seed", "1"]) == 0
    captured = capsys.readouterr()
    assert captured.out == greedy
    assert captured.err == ("attnkit: warning: --top-k and --seed have no effect: generation is greedy (the model's "
                            "default: no generation_config.json that samples); give --temperature above 0 to sample\n")
    assert main(["generate", "hi", "--model", model_dir, "--max-new-tokens", "4", "--temperature", "0", "--top-p", "0.5"]) == 0
    assert capsys.readouterr().err.startswith("attnkit: warning: --top-p has no effect: generation is greedy (--temperature 0)")
    assert main(["generate", "hi", "--model", model_dir, "--max-new-tokens", "4", "--temperature", "0.8", "--top-k", "5", "--seed", "1"]) == 0
    assert capsys.readouterr().err == ""


def _stdin(data):
    return io.TextIOWrapper(io.BytesIO(data), encoding="utf-8")


def test_chat_drops_a_byte_order_mark_and_names_bytes_that_are_not_utf8(model_dir, capsys, monkeypatch):
    from attnkit.pipelines.causal_lm import PretrainedCausalLM

    received, original = [], PretrainedCausalLM.stream_chat

    def spy(self, messages, **options):  # the real method, its messages noted
        received.append([m["content"] for m in messages if m["role"] == "user"])
        return original(self, messages, **options)

    monkeypatch.setattr(PretrainedCausalLM, "stream_chat", spy)
    monkeypatch.setattr("sys.stdin", _stdin(b"\xef\xbb\xbfhi\r\n\xef\xbb\xbfagain\n"))
    assert main(["chat", "--model", model_dir, "--max-new-tokens", "2"]) == 0
    assert received == [["hi"], ["hi", "\ufeffagain"]]  # a mark inside the text (line 2) is the user's text
    monkeypatch.setattr("sys.stdin", _stdin(b"hi\nbad \xff byte\n"))
    capsys.readouterr()
    assert main(["chat", "--model", model_dir, "--max-new-tokens", "2"]) == 2
    assert capsys.readouterr().err == "attnkit: error: stdin line 2 is not UTF-8 text (byte 0xff at offset 4)\n"


def _reader(stream, into):
    def run():
        for chunk in iter(lambda: os.read(stream.fileno(), 4096), b""):
            into.put(chunk)
    threading.Thread(target=run, daemon=True).start()


def _wait(what, condition, timeout=240):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_ctrl_c_during_a_chat_reply_stops_that_reply_only(tmp_path):
    """A real chat process: Ctrl-C during a reply ended the whole conversation; it now stops the reply at
    its next token, the chat reads the next message, and Ctrl-C at the prompt ends it (130)."""
    path = save_tiny_llama(tmp_path / "endless", eos_token_id=None)  # no stop token: a reply runs until Ctrl-C
    process = subprocess.Popen(
        [sys.executable, "-m", "attnkit.cli", "chat", "--model", path, "--max-new-tokens", "1000000"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    out, err = queue.Queue(), queue.Queue()
    _reader(process.stdout, out)
    _reader(process.stderr, err)
    got = {"out": b"", "err": b""}

    def received(name, q):
        def check():
            while not q.empty():
                got[name] += q.get()
            return got[name]
        return check

    stdout, stderr = received("out", out), received("err", err)
    stopped = b"attnkit: note: reply stopped (Ctrl-C); Ctrl-C at the prompt, or Ctrl-D, ends the chat\n"
    try:
        for n, message in enumerate((b"hello\n", b"and again\n"), start=1):
            before = len(stdout())
            process.stdin.write(message)
            process.stdin.flush()
            _wait(f"reply {n}", lambda: len(stdout()) > before + 8)
            process.send_signal(signal.SIGINT)
            _wait(f"reply {n} to stop", lambda: stderr().count(stopped) == n)
        process.send_signal(signal.SIGINT)  # at the prompt: the chat ends
        assert process.wait(timeout=120) == 130
    finally:
        if process.poll() is None:
            process.kill()
    time.sleep(0.2)
    assert stderr().endswith(b"attnkit: interrupted\n") and b"Traceback" not in stderr()
    assert stdout().count(b"\n") >= 2 and stderr().count(stopped) == 2  # two replies, each stopped and ended by a newline
