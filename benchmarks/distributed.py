"""Multi-process training: samples/s with 1 and 2 processes per backend, and the expected scaling (`make bench`).

    python benchmarks/distributed.py [--quick] [--backends torch,jax,tensorflow]

Each case is one `attnkit train --processes P` run; its rate is that of its last epoch (the first
compiles). The all-reduce time per step is not visible inside jax's and tensorflow's compiled steps,
so it is derived from the two measured step times, assuming the compute splits evenly:

    t1 = step time, 1 process, global batch B          (compute of B examples)
    t2 = step time, 2 processes, B / 2 each            (compute of B / 2, plus one all-reduce)
    a  = t2 - t1 / 2                                   (the all-reduce of the gradients)

With P processes on P cores a ring all-reduce moves 2 (P - 1) / P times the gradients' size per
process (1 at P = 2), so the expected step time is t1 / P + 2 a (P - 1) / P, and the expected
speed-up is t1 over that. On a machine with fewer cores than processes (like CI's 2) the
measured rates say more about the machine's load than about the engines.
"""

import argparse
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")
sys.path.insert(0, HERE)

from timing import markdown_table, print_rows  # noqa: E402

EPOCH_LINE = re.compile(r"^epoch (\d+)/(\d+): loss \S+; ([0-9.]+) s, ([0-9.]+) samples/s$")
FULL = ["--epochs", "3", "--train-size", "4096", "--validation-size", "64", "--batch-size", "128"]
QUICK = ["--epochs", "2", "--train-size", "64", "--validation-size", "8", "--batch-size", "16", "--d-model", "16", "--heads", "2",
         "--layers", "1", "--d-ff", "32"]
SCALING = (2, 4, 8, 16)


def measure(backend, processes, settings, output_dir):
    """(step seconds, samples/s) of the last epoch of one run."""
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run(
        [sys.executable, "-m", "attnkit.cli", "train", "--processes", str(processes), *settings, "--dropout", "0",
         "--quiet", "--force", "--output-dir", output_dir],
        env=env, capture_output=True, text=True,
    )
    if run.returncode != 0:
        raise RuntimeError((run.stderr.strip().splitlines() or [f"exit status {run.returncode}"])[-1])
    epochs = [EPOCH_LINE.match(line) for line in run.stdout.splitlines()]
    last = [m for m in epochs if m][-1]
    batch = int(settings[settings.index("--batch-size") + 1])
    steps = int(settings[settings.index("--train-size") + 1]) // batch
    return float(last.group(3)) / steps, float(last.group(4))


def expected_speedup(t1, t2, processes):
    """t1 / (t1 / P + 2 a (P - 1) / P) with a = t2 - t1 / 2 (floored at 0: a faster-than-even split)."""
    allreduce = max(0.0, t2 - t1 / 2)
    return t1 / (t1 / processes + 2 * allreduce * (processes - 1) / processes), allreduce


def rows_for(backend, settings, scratch, bench_rows):
    """The table's row for `backend`; appends `make bench`'s row (2 processes against 1) to `bench_rows`."""
    (t1, rate1), (t2, rate2) = (measure(backend, p, settings, os.path.join(scratch, f"{backend}-{p}")) for p in (1, 2))
    speedups = [expected_speedup(t1, t2, p)[0] for p in SCALING]
    allreduce = expected_speedup(t1, t2, 2)[1]
    batch = settings[settings.index("--batch-size") + 1]
    bench_rows.append(dict(
        workload=f"attnkit train --processes 2, global batch {batch} (per step)", backend=backend, dtype="float32",
        attnkit_s=t2, anchor="1 process", anchor_s=t1, rate=f"{rate2:.0f} samples/s", gflop=None,
        note=f"all-reduce {allreduce * 1e3:.1f} ms a step (derived); expected speed-up on 2 cores {speedups[0]:.2f}x"))
    return [backend, f"{rate1:.0f}", f"{rate2:.0f}", f"{t1 * 1e3:.1f}", f"{t2 * 1e3:.1f}", f"{allreduce * 1e3:.1f}",
            *(f"{s:.2f}x" for s in speedups)]


def main(argv=None):
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model and 4 steps: checks that it runs, not a timing")
    parser.add_argument("--backends", default="torch,jax,tensorflow")
    parser.add_argument("--rows", action="store_true", help="print the rows of `make bench`'s table (run.py) as JSON")
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else FULL
    header = ["backend", "1 proc samples/s", "2 proc samples/s", "t1 step ms", "t2 step ms", "all-reduce ms (derived)",
              *(f"expected {p} cores" for p in SCALING)]
    rows, bench_rows = [], []
    with tempfile.TemporaryDirectory() as scratch:
        for backend in args.backends.split(","):
            try:
                rows.append(rows_for(backend, settings, scratch, bench_rows))
            except RuntimeError as e:
                rows.append([f"{backend} failed: {e}"] + [""] * (len(header) - 1))
                bench_rows.append(dict(workload=f"(attnkit train --processes 2: failed: {e})", backend=backend, dtype="",
                                       attnkit_s=None, anchor="", anchor_s=None, gflop=None, note=""))
    print(("Quick settings (a smoke run, not a timing): " if args.quick else "Settings: ") + " ".join(settings))
    print(markdown_table(header, rows))
    if args.rows:
        print_rows(bench_rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
