"""Timing helpers for the benchmarks: medians of repeated runs, a Markdown table, and the rows a
script hands to `make bench`'s one table (`print_rows`)."""

import json
import statistics
import time

ROWS_PREFIX = "ROWS "


def print_rows(rows):
    """Prints `rows` for run.py's table as one last line, ROWS_PREFIX + JSON. A row is a dict:
    workload, backend, dtype; attnkit_s and anchor_s, seconds of the same unit of work (None: that
    side did not run, `anchor_missing` says why in the anchor's cell); anchor, its name; gflop (the
    work's GFLOP, for the fraction of the matmul peak) or rate (a text such as "57 tok/s (42% of
    ceiling)") with rate_fraction; note; and the goals: goal (anchor / attnkit at least), peak_goal
    (rate_fraction or the fraction of peak at least)."""
    print(ROWS_PREFIX + json.dumps(rows), flush=True)


def median_seconds(fn, *, warmup=3, repeats=15, min_time=0.0):
    """Median wall time of `fn()` over `repeats` runs after `warmup` runs."""
    for _ in range(warmup):
        fn()
    times = []
    start = time.perf_counter()
    while len(times) < repeats or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def markdown_table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


PAUSE_S = 0.1  # between two timed runs (`interleaved_medians`)


def interleaved_medians(runs, *, rounds=7, warmup=1, min_seconds=0.0):
    """Median wall time of each of `runs` (name -> fn), timed in turn A, B, A, B, ... per round.

    Interleaving gives every implementation the same share of a machine whose load changes. At
    least `rounds` rounds run, and more until `min_seconds` have passed: a median of 3 moved the
    encoder's ratio by +-3% between runs, of ~15 by +-1.5%.
    """
    for fn in runs.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in runs}
    start = time.perf_counter()
    while len(next(iter(times.values()))) < rounds or time.perf_counter() - start < min_seconds:
        for name, fn in runs.items():
            # The previous run's worker threads (OpenMP's, XLA's, tensorflow's) spin a while after
            # their work before they sleep: started at once, the next run would share the cores
            # with them (a torch anchor after a jax run took twice its time).
            time.sleep(PAUSE_S)
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}
