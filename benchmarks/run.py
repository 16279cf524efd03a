"""attnkit against its anchors: one Markdown table (`make bench`).

    python benchmarks/run.py [--quick] [--backends torch,jax,tensorflow]

Each row: attnkit's median time and the anchor's, measured in turn (A, B, A, B, ...) in the same
process; their ratio (anchor / attnkit: > 1 means attnkit is faster); and attnkit's achieved GFLOP/s
as a fraction of the machine's peak: per dtype, the fastest 2048^3 matmul of torch, XLA (jax),
tensorflow and numpy, timed in this run before and after the rows (`peak.py`). The torch rows run
here; the jax and tensorflow rows run in child processes with KERAS_BACKEND set (`--child`), which
print their rows as JSON. The long-sequence rows run one process per case so that each peak memory
is its own. The language-model workloads (generation against transformers, quantized decoding against
llama.cpp and CTranslate2, the server against llama.cpp's, LoRA fine-tuning against PEFT, multi-process
training against one process) come from their own scripts, each run as a child that prints its rows
(`timing.print_rows`), as does the embedding row against ONNX Runtime; their rate column is tokens/s, and for decoding its fraction of the memory
bandwidth ceiling. An anchor that is not installed leaves its cell saying so.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

from timing import ROWS_PREFIX

HERE = os.path.dirname(os.path.abspath(__file__))
LONG_T = 16384
# workloads.WORKLOADS, run in every backend, then the T=LONG_T rows, one process per case (run.py
# imports workloads only after choosing the backend).
WORKLOAD_NAMES = ("mha", "encoder-float32", "encoder-bfloat16", "training-step", "embeddings", "embeddings-bfloat16",
                  "encoder-families", "long-attention", "demo-time-to-99", "lm-generation", "quantized", "finetune",
                  "serve", "distributed", "embeddings-onnx")
# The workloads of a script of their own (a model loaded per process, servers, processes), each run in
# a child process that prints its rows (`timing.print_rows`): name -> (script, arguments per backend,
# or None: one run for all backends, given --backends).
SCRIPTS = {
    "lm-generation": ("lm_generation.py", lambda b: ["--backend", b]),
    # on jax and tensorflow three dtypes: each dtype compiles its own programs
    "quantized": ("quantized.py", lambda b: ["--backend", b] + ([] if b == "torch" else ["--dtype", "float32", "int8", "gguf"])),
    "finetune": ("finetune.py", lambda b: ["--backend", b]),
    "serve": ("serve.py", lambda b: [] if b == "torch" else None),  # the torch server: its engine batches on torch
    "distributed": ("distributed.py", None),
    "embeddings-onnx": ("embeddings.py", lambda b: [] if b == "torch" else None),  # issue 41's goal is torch's
}


def script_rows(name, backends, quick):
    """The rows of SCRIPTS[name] for `backends`, each run a child process; a run that fails is a row
    that says so."""
    script, per_backend = SCRIPTS[name]
    runs = [(",".join(backends), ["--backends", ",".join(backends)])] if per_backend is None else [
        (b, per_backend(b)) for b in backends if per_backend(b) is not None]
    rows = []
    for backend, arguments in runs:
        command = [sys.executable, os.path.join(HERE, script), "--rows", *(["--quick"] if quick else []), *arguments]
        env = {**os.environ, "KERAS_BACKEND": backend.split(",")[0]}
        out = subprocess.run(command, capture_output=True, text=True, env=env)
        found = [line for line in out.stdout.splitlines() if line.startswith(ROWS_PREFIX)]
        if out.returncode != 0 or not found:
            tail = (out.stderr.strip().splitlines() or [f"exit status {out.returncode}"])[-1]
            rows.append(failure_row(f"{script}", backend, tail))
            continue
        rows += json.loads(found[-1][len(ROWS_PREFIX):])
    return rows


def long_sequence_rows(rounds, backends):
    """T=16384 self-attention: attnkit.ops.fused_attention on each backend vs torch SDPA, time and peak memory.

    A case whose process fails (killed for memory, a backend that does not import) becomes a row that
    says so; the other rows, and the rest of the table, still print."""
    workload = f"Self-attention B=1 h=8 T={LONG_T} d_k=64"

    def case(name, backend):
        out = subprocess.run([sys.executable, os.path.join(HERE, "long_attention.py"), name, "--T", str(LONG_T)],
                             capture_output=True, text=True, env={**os.environ, "KERAS_BACKEND": backend})
        if out.returncode != 0:
            tail = (out.stderr.strip().splitlines() or [f"exit status {out.returncode}"])[-1]
            raise CaseFailed(f"{name} on {backend}: {tail}")
        return json.loads(out.stdout.strip().splitlines()[-1])

    cases = [("torch", "torch")] + [("attnkit", b) for b in backends]  # the anchor first, then attnkit per backend
    results, failed = {c: [] for c in cases}, {}
    for _ in range(rounds):
        for name, backend in cases:
            if (name, backend) not in failed:
                try:
                    results[name, backend].append(case(name, backend))
                except CaseFailed as e:
                    failed[name, backend] = str(e)
    if ("torch", "torch") in failed:
        return [failure_row(workload, "torch", failed["torch", "torch"])]
    seconds = {c: statistics.median(r["seconds"] for r in rs) for c, rs in results.items() if c not in failed}
    peak = {c: statistics.median(r["peak_bytes"] for r in rs) / 2**20 for c, rs in results.items() if c not in failed}
    gflop = 4 * 8 * LONG_T * LONG_T * 64 / 1e9
    rows = []
    for backend in backends:
        if ("attnkit", backend) in failed:
            rows.append(failure_row(workload, backend, failed["attnkit", backend]))
            continue
        try:
            refused = case("explicit", backend)
            size = refused["error"] and refused["error"].split("tensor of shape ")[1].split(", above")[0]
            explicit = "explicit path (weights): " + (f"refused before allocating {size}" if size else "NOT refused")
        except CaseFailed as e:
            explicit = f"explicit path (weights): its process failed ({e})"
        how = "" if backend == "torch" else ", compiled, tiles of 512 x 256"
        rows.append(dict(
            workload=workload, backend=backend, dtype="float32",
            attnkit_s=seconds["attnkit", backend], anchor="torch SDPA", anchor_s=seconds["torch", "torch"],
            gflop=gflop, note=f"peak memory {peak['attnkit', backend]:.0f} MiB vs {peak['torch', 'torch']:.0f} MiB"
                              f"{how}; {explicit}"))
    return rows


class CaseFailed(RuntimeError):
    """A benchmark case's process ended with an error."""


def failure_row(workload, backend, message):
    """A table row saying that `workload` on `backend` failed, and how."""
    return dict(workload=f"({workload}: failed: {message})", backend=backend, dtype="", attnkit_s=None,
                anchor="", anchor_s=None, gflop=None, note="")


def child_rows(backend, rounds, names):
    out = subprocess.run([sys.executable, __file__, "--child", "--rounds", str(rounds), "--workloads", names],
                         capture_output=True, text=True, env={**os.environ, "KERAS_BACKEND": backend})
    if out.returncode != 0:
        tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
        return [failure_row(f"{backend} rows", backend, tail)]
    return json.loads(out.stdout.strip().splitlines()[-1])


def goal_cell(r, ratio, fraction):
    """'>= 1.10x met', '>= 1.10x MISSED', with the fraction-of-peak goal where the row has one."""
    parts = []
    if r.get("goal") is not None:
        verdict = "not measured (no anchor)" if ratio is None else "met" if ratio >= r["goal"] else "MISSED"
        parts.append(f">= {r['goal']:.2f}x {verdict}")
    if r.get("peak_goal") is not None and fraction is not None:
        of = "ceiling" if r.get("rate") is not None else "peak"
        parts.append(f">= {r['peak_goal']:.0%} of {of} {'met' if fraction >= r['peak_goal'] else 'MISSED'}")
    return "; ".join(parts)


def table(rows, peaks):
    from timing import markdown_table

    lines = []
    for r in rows:
        ours, theirs = r["attnkit_s"], r["anchor_s"]
        if ours is None:
            lines.append([r["workload"], r["backend"], "", "", "", "", "", "", "", r["note"]])
            continue
        peak = peaks["bfloat16" if r["dtype"] == "bfloat16" else "float32"]
        if r.get("rate") is not None:  # a rate of its own (tokens/s against a bandwidth ceiling)
            fraction, achieved = r.get("rate_fraction"), r["rate"]
        else:
            fraction = None if r.get("gflop") is None else r["gflop"] / ours / peak
            achieved = "" if fraction is None else f"{r['gflop'] / ours:.0f} ({fraction:.0%})"
        if theirs is None:  # the anchor did not run, or never finished (the demo row's plain loop short of 99%)
            lines.append([r["workload"], r["backend"], r["dtype"], f"{ours * 1e3:.1f}", r["anchor"],
                          r.get("anchor_missing", "never"), "", achieved, goal_cell(r, None, fraction), r["note"]])
            continue
        lines.append([
            r["workload"], r["backend"], r["dtype"], f"{ours * 1e3:.1f}", r["anchor"], f"{theirs * 1e3:.1f}",
            f"**{theirs / ours:.2f}x**", achieved, goal_cell(r, theirs / ours, fraction), r["note"],
        ])
    header = ["workload", "backend", "dtype", "attnkit ms", "anchor", "anchor ms", "anchor/attnkit",
              "attnkit GFLOP/s or rate (of peak or ceiling)", "goal", "note"]
    return markdown_table(header, lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (about 3 times faster, noisier)")
    parser.add_argument("--backends", default="torch,jax,tensorflow")
    parser.add_argument("--workloads", default=",".join(WORKLOAD_NAMES),
                        help=f"comma-separated subset of {','.join(WORKLOAD_NAMES)} (default all)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, HERE)
    rounds = args.rounds or (1 if args.quick else 3)
    names = [n for n in args.workloads.split(",") if n]
    in_process = [n for n in names if n != "long-attention" and n not in SCRIPTS]
    unknown = sorted(set(names) - set(WORKLOAD_NAMES))
    if unknown:
        parser.error(f"--workloads: unknown {', '.join(unknown)}; choose from {', '.join(WORKLOAD_NAMES)}")
    if args.child:
        import workloads

        print(json.dumps(workloads.all_rows(rounds, in_process)))
        return

    os.environ["KERAS_BACKEND"] = "torch"
    import torch
    import workloads

    backends = args.backends.split(",")
    from peak import cpu_description, matmul_peaks, peaks_table

    load_before = os.getloadavg()
    peaks, by_engine = matmul_peaks(2 if args.quick else 3)
    rows = workloads.all_rows(rounds, in_process) if "torch" in backends else []
    for backend in backends:
        if backend != "torch" and in_process:
            rows += child_rows(backend, rounds, ",".join(in_process))
    if "long-attention" in names:
        rows += long_sequence_rows(1 if args.quick else 2, backends)
    for name in names:
        if name in SCRIPTS:
            rows += script_rows(name, backends, args.quick)
    later_peaks, later_by_engine = matmul_peaks(2 if args.quick else 3)
    peaks = {dtype: max(peaks[dtype], later_peaks[dtype]) for dtype in peaks}  # the machine's peak
    for dtype, engines in by_engine.items():  # each engine's best of the two measurements
        for name, rate in later_by_engine[dtype].items():
            if isinstance(rate, float) and (not isinstance(engines[name], float) or rate > engines[name]):
                engines[name] = rate
    load_after = os.getloadavg()

    print(f"attnkit benchmarks: {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads, "
          f"{'quick, ' if args.quick else ''}medians of interleaved rounds: at least {rounds} per workload, "
          f"and at least {workloads.SECONDS_PER_ROUND * rounds:.0f} s of them")
    print(f"load average (1, 5, 15 min): before {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, "
          f"after {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}")
    print(f"CPU: {cpu_description()}")
    print(f"peak (the fastest engine's matmul 2048^3, A @ B^T): float32 {peaks['float32']:.0f} GFLOP/s, "
          f"bfloat16 {peaks['bfloat16']:.0f} GFLOP/s\n")
    print(peaks_table(by_engine) + "\n")
    print(table(rows, peaks))


if __name__ == "__main__":
    main()
