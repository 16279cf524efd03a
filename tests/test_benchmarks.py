"""The benchmark programs in benchmarks/ (`make bench`): their arithmetic and their memory probe.

The timings themselves are not tested (the machines are shared and noisy); what is tested is that the
table reports anchor / attnkit and the fraction of peak correctly, that the rounds are interleaved,
and that the long-sequence probe measures a peak and reports the explicit path's refusal.
"""

import json
import os
import subprocess
import sys

import keras
import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCHMARKS)

import run  # noqa: E402
import timing  # noqa: E402


def test_interleaved_medians_alternate_the_runs_and_take_medians(monkeypatch):
    # A fake clock: each timed run advances it by the next of its durations (warm-up runs by nothing).
    durations = {"a": iter([5, 1, 3]), "b": iter([2, 2, 9])}
    now, calls = [0.0], []

    def run_of(name):
        def fn():
            calls.append(name)
            if len(calls) > 2:  # after the two warm-up calls
                now[0] += next(durations[name])
        return fn

    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])
    medians = timing.interleaved_medians({"a": run_of("a"), "b": run_of("b")}, rounds=3, warmup=1)
    assert calls == ["a", "b"] * 4
    assert medians == {"a": 3, "b": 2}


def test_table_reports_anchor_over_attnkit_and_the_fraction_of_peak():
    rows = [
        dict(workload="MHA", backend="torch", dtype="float32", attnkit_s=0.2, anchor="keras", anchor_s=0.25,
             gflop=30.0, note="n", goal=1.1),
        dict(workload="Encoder", backend="torch", dtype="bfloat16", attnkit_s=0.5, anchor="torch", anchor_s=0.4,
             gflop=10.0, note="", goal=1.1, peak_goal=0.4),
        dict(workload="(jax rows failed: boom)", backend="jax", dtype="", attnkit_s=None, anchor="", anchor_s=None,
             gflop=None, note=""),
    ]
    lines = run.table(rows, {"float32": 200.0, "bfloat16": 40.0}).splitlines()
    assert lines[0].startswith("| workload | backend | dtype | attnkit ms | anchor | anchor ms | anchor/attnkit")
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    assert cells[0][3:8] == ["200.0", "keras", "250.0", "**1.25x**", "150 (75%)"]  # 30 GFLOP in 0.2 s of 200
    assert cells[1][6:8] == ["**0.80x**", "20 (50%)"]  # bfloat16 rows against the bfloat16 peak
    assert cells[0][8] == ">= 1.10x met" and cells[1][8] == ">= 1.10x MISSED; >= 40% of peak met"  # a missed goal says so
    assert cells[2][0] == "(jax rows failed: boom)" and cells[2][3] == ""


def long_attention(case, T, budget=None):
    env = {**os.environ, "KERAS_BACKEND": keras.backend.backend()}
    if budget is not None:
        env["ATTNKIT_MAX_SCORES_BYTES"] = str(budget)
    out = subprocess.run([sys.executable, os.path.join(BENCHMARKS, "long_attention.py"), case, "--T", str(T)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_long_attention_probe_times_the_fused_path_and_measures_its_peak():
    result = long_attention("attnkit", 1024)
    assert result["backend"] == keras.backend.backend() and result["T"] == 1024
    assert result["error"] is None and result["seconds"] > 0 and result["peak_bytes"] >= 0


def test_long_attention_probe_reports_the_explicit_paths_refusal():
    # (1, 8, 1024, 1024) float32 scores are 32 MiB; a 1 MiB budget refuses them before allocating.
    result = long_attention("explicit", 1024, budget=2**20)
    assert result["seconds"] is None and "above the budget" in result["error"]
    assert result["peak_bytes"] < 32 * 2**20


@pytest.mark.skipif(keras.backend.backend() != "torch", reason="the anchor case is torch's SDPA")
def test_long_attention_probe_runs_the_torch_anchor():
    result = long_attention("torch", 1024)
    assert result["error"] is None and result["seconds"] > 0


def test_interleaved_medians_keep_going_until_min_seconds(monkeypatch):
    now, calls = [0.0], []

    def one_second():
        calls.append(1)
        now[0] += 1.0

    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])
    timing.interleaved_medians({"a": one_second}, rounds=2, warmup=0, min_seconds=5.0)
    assert len(calls) == 5  # 2 rounds asked for, 5 needed to fill 5 seconds


@pytest.mark.skipif(keras.backend.backend() != "torch", reason="the long rows run torch's anchor in a subprocess")
def test_a_failed_long_attention_case_is_a_row_not_a_crash(monkeypatch):
    """A backend whose process fails (here one that does not exist) gets a row saying so; the others'
    rows still come, with their numbers."""
    monkeypatch.setattr(run, "LONG_T", 256)
    rows = run.long_sequence_rows(1, ["torch", "nonexistent"])
    assert [r["backend"] for r in rows] == ["torch", "nonexistent"]
    assert rows[0]["attnkit_s"] > 0 and rows[0]["anchor_s"] > 0
    assert rows[1]["attnkit_s"] is None and "failed: attnkit on nonexistent" in rows[1]["workload"]
    assert "nonexistent" in run.table(rows, {"float32": 100.0, "bfloat16": 10.0})


def test_a_failed_workload_is_a_row_not_a_crash(monkeypatch):
    import workloads

    def broken(rounds):
        raise ImportError("No module named 'sentence_transformers'")

    monkeypatch.setitem(workloads.WORKLOADS, "embeddings", broken)
    (row,) = workloads.all_rows(1, ["embeddings"])
    assert row["attnkit_s"] is None
    assert row["workload"] == "(embeddings: failed: ImportError: No module named 'sentence_transformers')"


def test_the_peak_is_the_fastest_engine_and_engines_that_cannot_run_say_why(monkeypatch):
    import peak

    seconds = {"fast": 0.5, "slow": 2.0}

    def engine(name):
        def time_it(dtype, repeats):
            if name == "broken" or (name == "slow" and dtype == "bfloat16"):
                raise TypeError(f"{name} has no {dtype} GEMM")
            return seconds[name]
        return time_it

    monkeypatch.setattr(peak, "ENGINES", {n: engine(n) for n in ("slow", "fast", "broken")})
    best, by_engine = peak.matmul_peaks(repeats=1)
    flop = 2 * peak.N**3 / 1e9
    assert best == {"float32": flop / 0.5, "bfloat16": flop / 0.5}
    assert by_engine["float32"]["slow"] == flop / 2.0
    assert by_engine["bfloat16"]["slow"] == "TypeError: slow has no bfloat16 GEMM"
    table = peak.peaks_table(by_engine)
    assert "(TypeError: broken has no float32 GEMM)" in table and f"| fast | {flop / 0.5:.0f} |" in table


def test_the_cpu_line_names_the_gemm_flags():
    import peak

    line = peak.cpu_description()
    assert "avx512_bf16" in line and "amx_bf16" in line  # each flag is listed as present or absent
    assert ("has " in line and "lacks " in line) or "flags unknown" in line


def test_rate_rows_report_their_ceiling_and_a_missing_anchor_says_why():
    rows = [
        dict(workload="Decoding", backend="torch", dtype="gguf", attnkit_s=0.02, anchor="llama.cpp", anchor_s=0.01,
             rate="50.0 tok/s (40% of ceiling)", rate_fraction=0.4, gflop=None, note="", goal=1.0, peak_goal=0.7),
        dict(workload="Prefill", backend="torch", dtype="gguf", attnkit_s=0.1, anchor="llama.cpp", anchor_s=None,
             anchor_missing="not installed", rate="1280 tok/s", gflop=None, note="", goal=1.5),
    ]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in run.table(rows, {"float32": 1.0, "bfloat16": 1.0}).splitlines()[2:]]
    assert cells[0][3:9] == ["20.0", "llama.cpp", "10.0", "**0.50x**", "50.0 tok/s (40% of ceiling)",
                             ">= 1.00x MISSED; >= 70% of ceiling MISSED"]
    assert cells[1][5:9] == ["not installed", "", "1280 tok/s", ">= 1.50x not measured (no anchor)"]


def test_a_scripts_rows_come_from_its_last_rows_line_and_a_failed_script_is_a_row(monkeypatch):
    from timing import ROWS_PREFIX

    runs = []

    def fake_run(command, capture_output, text, env):
        runs.append((command, env["KERAS_BACKEND"]))
        if "--backend" in command and command[command.index("--backend") + 1] == "jax":
            return subprocess.CompletedProcess(command, 1, "", "Traceback ...\nRuntimeError: no jax here\n")
        row = dict(workload="w", backend=env["KERAS_BACKEND"], dtype="float32", attnkit_s=1.0, anchor="a", anchor_s=2.0)
        return subprocess.CompletedProcess(command, 0, f"a table\n{ROWS_PREFIX}[]\n{ROWS_PREFIX}{json.dumps([row])}\n", "")

    monkeypatch.setattr(run.subprocess, "run", fake_run)
    rows = run.script_rows("finetune", ["torch", "jax"], quick=True)
    assert [c[-2:] for c, _ in runs] == [["--backend", "torch"], ["--backend", "jax"]]
    assert all("--rows" in c and "--quick" in c for c, _ in runs) and [b for _, b in runs] == ["torch", "jax"]
    assert rows[0]["backend"] == "torch" and rows[0]["anchor_s"] == 2.0  # the last ROWS line
    assert rows[1]["attnkit_s"] is None and rows[1]["workload"] == "(finetune.py: failed: RuntimeError: no jax here)"
    runs.clear()
    run.script_rows("serve", ["torch", "jax"], quick=False)  # the server runs on torch only
    assert len(runs) == 1 and "--quick" not in runs[0][0]


def test_quantized_rows_pair_each_dtype_with_its_anchor_and_ceiling():
    import quantized

    measured = [("attnkit torch", "gguf", 1, 100e6, 0.2, 0.010), ("attnkit torch", "int8", 8, 150e6, 0.9, 0.040),
                ("llama.cpp", "file's blocks", 1, 100e6, 0.4, 0.012), ("CTranslate2", "int8", 1, 0, 0.1, 0.02)]
    rows = quantized.bench_rows(measured, {}, "torch", 128, 20e9)
    decode, prefill, decode8, prefill8 = rows
    assert (decode["anchor"], decode["anchor_s"], decode["goal"], decode["peak_goal"]) == ("llama.cpp", 0.012, 1.0, 0.7)
    assert decode["rate_fraction"] == pytest.approx(100e6 / (0.010 * 20e9))  # bytes a token over bandwidth x time
    assert (prefill["anchor_s"], prefill["goal"]) == (0.4, 1.5)
    assert (decode8["anchor"], decode8["anchor_s"], decode8["attnkit_s"], decode8["goal"]) == ("CTranslate2", 0.02, 0.005, None)
    assert prefill8["anchor_s"] is None and prefill8["anchor_missing"] == "batch 1 only"
    alone = quantized.bench_rows(measured[:1], {"llama.cpp": "not installed"}, "torch", 128, 20e9)
    assert alone[0]["anchor_s"] is None and alone[0]["anchor_missing"] == "not installed"


def test_quantized_steps_timed_below_zero_make_no_row_numbers():
    """On a busy machine an n-token run can time below the 1-token run: that step is 'timing invalid',
    not clamped to ~1e-9 s (a ratio of millions)."""
    import quantized

    assert quantized.valid_median([0.02, -0.01, 0.03]) == 0.03 and quantized.valid_median([0.02, -0.01, -0.03]) is None
    measured = [("attnkit torch", "gguf", 1, 100e6, 0.2, None), ("attnkit torch", "int8", 1, 150e6, 0.3, 0.02),
                ("llama.cpp", "file's blocks", 1, 100e6, 0.4, None)]
    decode, prefill, decode_int8, _ = quantized.bench_rows(measured, {}, "torch", 128, 20e9)
    assert decode["attnkit_s"] is None and "timing invalid" in decode["note"]
    assert prefill["attnkit_s"] == 0.2 and prefill["anchor_s"] == 0.4  # the first token is still timed
    assert decode_int8["anchor_s"] is None and "timing invalid" in decode_int8["anchor_missing"]
