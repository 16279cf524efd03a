"""`attnkit explore`: the exported page, the served page's start and stop, and its one-line errors."""

import _thread
import json
import os
import signal
import subprocess
import sys
import urllib.request

import pytest

from attnkit import cli
from attnkit.explorer import server as server_module
from attnkit.explorer import sources
from attnkit.explorer.contract import to_json

from backend_utils import once_per_run  # noqa: E402

# The command's files, start, stop and one-line errors do not depend on the backend (the weights it
# shows are tested per backend in test_explorer_sources.py).
pytestmark = once_per_run


def one_line_error(capsys):
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("attnkit: error:"), err
    return err


def page_data(path):
    page = open(path, encoding="utf-8").read()
    return json.loads(page.split('id="attnkit-data">', 1)[1].split("</script>", 1)[0])


def test_export_writes_one_page_with_the_models_numbers(tiny_bert_dir, tiny_source, tmp_path, capsys):
    out = tmp_path / "page.html"
    text = "the cat sat on the mat"
    assert cli.main(["explore", "--model", tiny_bert_dir, "--export", str(out), "--text", text]) == 0
    assert page_data(out) == json.loads(to_json(tiny_source.attention(text)))
    written = f"wrote {out}: {tiny_source.name}, 8 tokens, 1 attention kind(s), 2 layers x 2 heads"
    assert written in capsys.readouterr().err
    assert os.listdir(tmp_path) == ["page.html"]  # no temporary file left beside it
    assert oct(out.stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_export_never_overwrites_without_force(tiny_bert_dir, tmp_path, capsys):
    out = tmp_path / "page.html"
    out.write_text("mine")
    argv = ["explore", "--model", tiny_bert_dir, "--export", str(out), "--text", "the cat"]
    assert cli.main(argv) == 2
    assert f"{out} already exists; pass --force to overwrite it" in one_line_error(capsys)
    assert out.read_text() == "mine"
    assert cli.main([*argv, "--force"]) == 0
    assert page_data(out)["text"] == "the cat"


def test_export_of_a_truncated_text_warns_and_the_page_says_so(tiny_bert_dir, tmp_path, capsys):
    out = tmp_path / "page.html"
    assert cli.main(["explore", "--model", tiny_bert_dir, "--export", str(out), "--text", "the cat sat " * 8]) == 0
    notes = page_data(out)["notes"]
    assert len(notes) == 1 and "so it was truncated to its first 16 tokens" in notes[0]
    assert f"attnkit: warning: {notes[0]}" in capsys.readouterr().err


def test_export_of_a_text_the_translator_reads_as_blank_is_one_line(translator_dir, tmp_path, capsys):
    out = tmp_path / "page.html"
    argv = ["explore", "--model", translator_dir, "--export", str(out), "--text", " " * 40 + "3/3/21"]
    assert cli.main(argv) == 1
    assert "characters, all that translator" in one_line_error(capsys)
    assert not out.exists()


def test_an_interrupted_export_leaves_the_old_file(tiny_bert_dir, tmp_path, monkeypatch):
    out = tmp_path / "page.html"
    out.write_text("old")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    assert cli.main(["explore", "--model", tiny_bert_dir, "--export", str(out), "--text", "the cat", "--force"]) == 130
    assert out.read_text() == "old" and os.listdir(tmp_path) == ["page.html"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--export", "p.html"], '--export needs the text: --text "..."'),
        (["--export", "p.html", "--text", "  "], "--text is empty: nothing to explore"),
        (["--export", "p.txt", "--text", "x"], "--export must end in .html. Received: p.txt"),
        (["--export", "p.html", "--text", "x", "--port", "8000"], "--port and --open are for the served page"),
        (["--export", "/no/such/dir/p.html", "--text", "x"], "--export /no/such/dir/p.html: no directory /no/such/dir"),
        (["--port", "70000"], "must be a port number from 0 to 65535"),
        (["--port", "-1"], "must be a non-negative integer"),
        (["--model", "/no/such/dir"], "model directory /no/such/dir does not exist"),
    ],
)
def test_usage_errors_are_one_line(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(server_module, "ExplorerServer", _no_server)
    assert cli.main(["explore", *argv]) in (1, 2)
    assert message in one_line_error(capsys)


def _no_server(*args, **kwargs):
    raise AssertionError("a server started before the error")


def test_an_unreadable_model_directory_fails_before_any_server(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(server_module, "ExplorerServer", _no_server)
    (tmp_path / "config.json").write_text("{not json")
    assert cli.main(["explore", "--model", str(tmp_path)]) == 1
    assert "config.json: not valid JSON" in one_line_error(capsys)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli.main(["explore", "--model", str(empty)]) == 1
    assert "holds neither a date translator" in one_line_error(capsys)


def test_a_busy_port_is_one_line(tiny_bert_dir, tiny_source, capsys, monkeypatch):
    monkeypatch.setattr(sources, "open_model", lambda path=None: tiny_source)
    busy = server_module.ExplorerServer(tiny_source, 0)
    try:
        port = busy.server_address[1]
        assert cli.main(["explore", "--model", tiny_bert_dir, "--port", str(port)]) == 2
        assert f"cannot serve on 127.0.0.1:{port}: Address already in use" in one_line_error(capsys)
    finally:
        busy.server_close()


def test_serve_prints_the_url_opens_it_and_stops_on_ctrl_c(tiny_bert_dir, tiny_source, capsys, monkeypatch):
    """--open hands the URL to the browser; Ctrl-C (a KeyboardInterrupt in the main thread) stops cleanly."""
    monkeypatch.setattr(sources, "open_model", lambda path=None: tiny_source)
    seen = {}

    def browser(url):
        with urllib.request.urlopen(_post(url, "the cat"), timeout=60) as response:
            seen["url"], seen["status"] = url, response.status
        _thread.interrupt_main()
        return True

    monkeypatch.setattr("webbrowser.open", browser)
    assert cli.main(["explore", "--model", tiny_bert_dir, "--open"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"attnkit explorer: {seen['url']} ({tiny_source.name}); Ctrl-C to stop\n")
    assert out.endswith("attnkit explorer: stopped\n") and seen["status"] == 200
    assert seen["url"].startswith("http://127.0.0.1:")


def test_the_command_serves_until_sigint(tiny_bert_dir):
    """What a user sees: the URL on stdout, the endpoint answering, exit status 0 after Ctrl-C."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_src(), os.environ.get("PYTHONPATH")]))}
    process = subprocess.Popen(
        [sys.executable, "-m", "attnkit.cli", "explore", "--model", tiny_bert_dir, "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        first = process.stdout.readline()
        assert first.startswith("attnkit explorer: http://127.0.0.1:"), first + process.stderr.read()
        url = first.split()[2]
        with urllib.request.urlopen(_post(url, "the cat"), timeout=60) as response:
            assert json.loads(response.read())["attention"][0]["query_tokens"] == ["[CLS]", "the", "cat", "[SEP]"]
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 0, err
    assert out == "attnkit explorer: stopped\n" and "Traceback" not in err


def _src():
    return os.path.join(os.path.dirname(__file__), "..", "..", "src")


def test_export_of_a_language_model(tiny_llama_dir, llama_source, tmp_path, capsys):
    out = tmp_path / "lm.html"
    text = "Once upon a time"
    argv = ["explore", "--lm", "--model", tiny_llama_dir, "--max-new-tokens", "12", "--export", str(out), "--text", text]
    assert cli.main(argv) == 0
    data = page_data(out)
    assert data == json.loads(to_json(llama_source.attention(text)))
    steps = len(data["steps"]["labels"])
    assert capsys.readouterr().err == (
        f"wrote {out}: {llama_source.name}, {len(text) + steps - 1} tokens, 1 attention kind(s), 2 layers x 4 heads, "
        f"{steps} decoding steps\n"
    )


@pytest.mark.parametrize(
    "argv, status, message",
    [
        (["--max-new-tokens", "0"], 2, "argument --max-new-tokens: must be a positive integer, not '0'"),
        (["--max-new-tokens", "-3"], 2, "argument --max-new-tokens: must be a positive integer, not '-3'"),
        (["--max-new-tokens", "65"], 2, "--max-new-tokens must be from 1 to 64. Received: 65"),
        (["--lm", "--model", "/no/such/model.gguf"], 1, "model file /no/such/model.gguf does not exist"),
        (["--lm", "--export", "p.html", "--text", " "], 2, "--text is empty: nothing to explore"),
        (["--model", "TINY_BERT", "--max-new-tokens", "5"], 1, "`max_new_tokens` is for a language model"),
        (["--model", "TINY_BERT", "--lm"], 1, "is not a language model: --lm takes a GGUF file"),
        (["--model", "NOT_GGUF", "--lm"], 1, "is neither a directory nor a GGUF file"),
    ],
)
def test_language_model_errors_are_one_line(argv, status, message, tiny_bert_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(server_module, "ExplorerServer", _no_server)
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_text("not GGUF")
    argv = [{"TINY_BERT": tiny_bert_dir, "NOT_GGUF": str(not_gguf)}.get(a, a) for a in argv]
    assert cli.main(["explore", *argv]) == status
    assert message in one_line_error(capsys)


def _post(url, text):
    """The page's request for the attention of `text` (the endpoint takes JSON POSTs only)."""
    return urllib.request.Request(url + "api/attention", data=json.dumps({"text": text}).encode(),
                                  headers={"Content-Type": "application/json"})
