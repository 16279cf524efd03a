"""Batch-1 and batch-8 decoding of SmolLM2 per weight dtype, against the memory-bandwidth ceiling and
llama.cpp / CTranslate2 when they are installed (`make bench`; issue 41, docs/decisions.md item 129).

    python benchmarks/quantized.py [--quick] [--backend torch] [--dtype float32 gguf ...] [--threads 2]

Rows: decode tokens/s, prefill tokens/s and time to the first token per dtype ("gguf": the file's
blocks kept packed; "int8" / "int4": attnkit's weight-only blocks, docs/decisions.md item 138; ":q8":
inputs rounded to 8-bit blocks, llama.cpp's arithmetic, item 144) and batch. The ceiling of a
decoding step is the bandwidth (torch.mv over 256 MB of float32, measured in this run) over the bytes of
the weights a step reads (all, less an untied model's embedding table), all read once a step: tokens/s <= batch x bandwidth / bytes. Each row gives its
fraction of it. llama.cpp (`llama_cpp`, same GGUF file) and CTranslate2 (int8, from the file
dequantized into a float32 HF directory) rows are anchors, skipped when absent. --quick: a tiny random
model, to check the script runs.
"""

import argparse
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
DTYPES = ("float32", "bfloat16", "int8", "int4", "gguf", "int8:q8", "int4:q8", "gguf:q8")  # ":q8": activations="q8"


def bandwidth(threads, megabytes=256, repeats=10):
    """Bytes/s torch.mv reads (a float32 matrix of `megabytes` times a vector): the machine's
    achievable memory bandwidth for a batch-1 step."""
    import torch

    torch.set_num_threads(threads)
    n = int((megabytes * 2**20 / 4) ** 0.5)
    a, x = torch.randn(n, n), torch.randn(n)
    torch.mv(a, x)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        torch.mv(a, x)
        times.append(time.perf_counter() - t)
    return a.numel() * 4 / sorted(times)[len(times) // 2]


def bfloat16_products():
    """Whether the CPU has bfloat16 dot products (AVX512-BF16 or AMX-BF16)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def step_bytes(model):
    """Bytes a decoding step reads: every variable, less the embedding table where the output does not
    read it (an untied `lm_head`: the step reads only its tokens' rows)."""
    import numpy as np

    from attnkit.layers.block_quantized import packed_bytes

    table = model.embedding.embeddings
    unread = 0 if model.lm_head is None else int(np.prod(table.shape)) * {"bfloat16": 2, "float16": 2}.get(table.dtype, 4)
    return packed_bytes(model) - unread


def tiny_gguf(path):
    """A 2-layer Q8_0 llama GGUF with a byte-level vocabulary (the --quick model)."""
    import gguf
    import numpy as np

    from attnkit.checkpoints.formats.gguf import bytes_to_unicode

    rng, d = np.random.default_rng(0), 64
    writer = gguf.GGUFWriter(path, "llama")
    for name, value in dict(block_count=2, context_length=64, embedding_length=d, feed_forward_length=d,
                            head_count=4, head_count_kv=2, rope_freq_base=10000.0, layer_norm_rms_eps=1e-5).items():
        getattr(writer, f"add_{name}")(value)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(list(bytes_to_unicode().values()))
    writer.add_token_merges([])
    writer.add_tensor("token_embd.weight", rng.standard_normal((256, d)).astype("float32"))
    writer.add_tensor("output_norm.weight", np.ones(d, "float32"))
    for i in range(2):
        for role, rows in (("attn_q", d), ("attn_k", d // 2), ("attn_v", d // 2), ("attn_output", d),
                           ("ffn_gate", d), ("ffn_up", d), ("ffn_down", d)):
            w = (rng.standard_normal((rows, d)) / 8).astype("float32")
            writer.add_tensor(f"blk.{i}.{role}.weight", gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", np.ones(d, "float32"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def timed(cases, new, rounds):
    """(time to first token, seconds a decoding step), medians, for each case (generate, prompts):
    `generate(prompts, n)` runs n tokens. The rounds interleave the cases, so a machine that slows
    down for a while slows every engine alike and the ratios of one run hold. A step is the n-token
    run less the 1-token run; on a busy machine the first can time below the second, and a case
    with such rounds in its majority has no step (None: "timing invalid"), not a clamped one."""
    firsts, steps = [[] for _ in cases], [[] for _ in cases]
    for generate, prompts in cases:
        generate(prompts, 2)  # warm-up: compiled programs, caches
    for _ in range(rounds):
        for i, (generate, prompts) in enumerate(cases):
            t = time.perf_counter()
            generate(prompts, 1)
            first = time.perf_counter() - t
            t = time.perf_counter()
            generate(prompts, new)
            whole = time.perf_counter() - t
            firsts[i].append(first)
            steps[i].append((whole - first) / (new - 1))
    return [(sorted(f)[rounds // 2], valid_median(s)) for f, s in zip(firsts, steps)]


def valid_median(steps):
    """The median of the positive `steps`, or None where they are not a majority of them."""
    valid = sorted(s for s in steps if s > 0)
    return valid[len(valid) // 2] if 2 * len(valid) > len(steps) else None


def llama_cpp_generate(path, threads):
    """llama.cpp's greedy generation of `n` tokens for each prompt (one at a time: batch 1 each), or None."""
    try:
        import llama_cpp
    except ImportError:
        return None
    llm = llama_cpp.Llama(model_path=path, n_threads=threads, n_ctx=512, verbose=False)

    def generate(prompts, n):
        for prompt in prompts:
            llm.reset()
            for i, _ in enumerate(llm.generate(prompt, temp=0.0, reset=True)):
                if i + 1 >= n:
                    break

    return generate


def ctranslate2_generate(path, threads):
    """CTranslate2 int8 greedy generation from the GGUF file dequantized (a float32 HF directory converted), or None."""
    try:
        import ctranslate2
        import transformers
    except ImportError:
        return None
    import json

    import numpy as np
    from safetensors.numpy import save_file

    from attnkit.checkpoints.formats.gguf import read_gguf
    from attnkit.pipelines.causal_checkpoint import load_causal_lm

    directory, out = tempfile.mkdtemp(), tempfile.mkdtemp()
    # transformers 5 keeps a GGUF file's blocks and will not save them: the float32 Hugging Face
    # directory is written from the file's dequantized weights (attnkit's reader, HF names)
    config, weights, info = read_gguf(path)
    save_file({name: np.ascontiguousarray(w) for name, w in weights.items()}, os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "config.json"), "w") as f:
        architecture = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[config["model_type"]]
        json.dump({**config, "architectures": [architecture], "torch_dtype": "float32"}, f)
    # the tokenizer attnkit reads from the file (transformers' GGUF tokenizer wants fields SmolLM2's lacks)
    tokenizer = load_causal_lm(path, dtype="gguf").tokenizer
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        special = {f"{role}_token": info["tokens"][info[f"{role}_token_id"]] for role in ("bos", "eos", "unk")
                   if info.get(f"{role}_token_id") is not None}  # CTranslate2's converter needs them named
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", **special}, f)
    ctranslate2.converters.TransformersConverter(directory).convert(out, quantization="int8", force=True)
    generator = ctranslate2.Generator(out, device="cpu", intra_threads=threads, compute_type="int8")

    def generate(prompts, n):
        tokens = [[tokenizer.id_to_token(t) for t in p] for p in prompts]
        generator.generate_batch(tokens, max_length=n, min_length=n, sampling_topk=1, include_prompt_in_result=False)

    return generate


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny random model and sizes (smoke test)")
    parser.add_argument("--backend", default="torch", choices=["torch", "jax", "tensorflow"])
    parser.add_argument("--dtype", nargs="+", default=list(DTYPES), choices=DTYPES)
    parser.add_argument("--batch", nargs="+", type=int, help="batch sizes (default 1 8)")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new", type=int, default=32, help="new tokens a generation")
    parser.add_argument("--rows", action="store_true", help="print the rows of `make bench`'s table (run.py) as JSON")
    args = parser.parse_args()
    os.environ["KERAS_BACKEND"] = args.backend
    import numpy as np
    import torch
    from peak import cpu_description
    from timing import markdown_table, print_rows

    from attnkit.pipelines.causal_checkpoint import default_causal_lm_path, load_causal_lm

    torch.set_num_threads(args.threads)
    if args.quick:
        prompt_len, new, batches, rounds = 8, 4, (1, 2), 1
        path = tiny_gguf(os.path.join(tempfile.mkdtemp(), "tiny.gguf"))
    else:
        prompt_len, new, batches, rounds = 128, args.new, (1, 8), args.rounds
        path = default_causal_lm_path()
    batches = tuple(args.batch or batches)
    bytes_per_second = bandwidth(args.threads, 16 if args.quick else 256)
    rows, measured = [], []

    def row(engine, dtype, batch, weight_bytes, first, step):
        measured.append((engine, dtype, batch, weight_bytes, first, step))
        if step is None:
            rows.append([engine, dtype, batch, INVALID, f"{batch * prompt_len / first:.0f}", f"{first * 1e3:.0f} ms", "-", "-"])
            return
        ceiling = batch * bytes_per_second / weight_bytes if weight_bytes else float("nan")
        rows.append([engine, dtype, batch, f"{batch / step:.1f}", f"{batch * prompt_len / first:.0f}", f"{first * 1e3:.0f} ms",
                     f"{weight_bytes / 1e6:.1f} MB" if weight_bytes else "-", f"{batch / step / ceiling:.0%}" if weight_bytes else "-"])

    cases = []  # (engine, dtype, batch, bytes a step reads, generate, prompts), timed together
    models = []
    for dtype in args.dtype:
        name, _, activations = dtype.partition(":")
        lm = load_causal_lm(path, dtype=name, activations=activations or None)
        models.append(lm)  # held: every case is timed in the same rounds
        for batch in batches:
            prompts = np.random.default_rng(0).integers(3, lm.model.vocab_size, (batch, prompt_len)).tolist()
            generate = (lambda lm: lambda p, n: lm.generate_ids(p, max_new_tokens=n, stop_tokens=[]))(lm)
            cases.append((f"attnkit {args.backend}", dtype, batch, step_bytes(lm.model), generate, prompts))
    file_bytes = os.path.getsize(path)
    # CTranslate2 is timed in its own rounds after the others, then freed: loaded beside attnkit, its
    # idle threads took the cores (attnkit's batch-1 decoding measured 22-31 tokens/s against 85)
    alone, skipped = [], {}  # skipped: engine -> why its rows are absent
    for engine, dtype, make in (("llama.cpp", "file's blocks", llama_cpp_generate), ("CTranslate2", "int8", ctranslate2_generate)):
        try:
            generate = make(path, args.threads)
        except Exception as error:  # an anchor that fails to load is reported, not fatal
            skipped[engine] = f"failed to load ({type(error).__name__}: {error})"
            print(f"{engine}: skipped ({type(error).__name__}: {error})")
            continue
        if generate is None:
            skipped[engine] = "not installed"
            print(f"{engine}: not installed, skipped")
            continue
        prompts = np.random.default_rng(0).integers(3, 250, (1, prompt_len)).tolist()
        # batch 1 (llama.cpp's API decodes one sequence)
        case = (engine, dtype, 1, file_bytes if engine == "llama.cpp" else 0, generate, prompts)
        (alone if engine == "CTranslate2" else cases).append(case)
        del generate, case
    for case, (first, step) in zip(cases, timed([c[4:] for c in cases], new, rounds)):
        row(*case[:4], first, step)
    while alone:
        case = alone.pop()
        (first, step), = timed([case[4:]], new, rounds)
        row(*case[:4], first, step)
        del case
    print(f"{cpu_description()}; {args.threads} threads; load average {os.getloadavg()[0]:.1f}; "
          f"torch.mv bandwidth {bytes_per_second / 1e9:.1f} GB/s; bfloat16 products: "
          f"{'yes' if bfloat16_products() else 'no (bfloat16 runs as float32 products)'}")
    print(markdown_table(["engine", "dtype", "batch", "decode tok/s", "prefill tok/s", "first token", "weights",
                          "decode / ceiling"], rows))
    if args.rows:
        print_rows(bench_rows(measured, skipped, args.backend, prompt_len, bytes_per_second))


INVALID = "timing invalid (the n-token runs timed below the 1-token run: a busy machine)"


def bench_rows(measured, skipped, backend, prompt_len, bytes_per_second):
    """`make bench`'s rows from `measured` [(engine, dtype, batch, bytes a step reads, first-token
    seconds, seconds a decoding step)]: per attnkit case a decoding row (seconds per token against
    llama.cpp's on the same file, or CTranslate2's for int8; its fraction of the bandwidth ceiling)
    and a prefill row (time to the first token against llama.cpp's). The anchors decode one sequence
    at a time: a batch-8 row compares tokens/s against their batch 1. The goals (issue 41) are
    torch's at batch 1. `skipped`: anchor -> why it did not run."""
    anchors = {engine: (first, step) for engine, _, _, _, first, step in measured if not engine.startswith("attnkit")}
    skipped = {**skipped, **{engine: INVALID for engine, (_, step) in anchors.items() if step is None}}
    decoded = {engine: times for engine, times in anchors.items() if times[1] is not None}
    out = []
    for engine, dtype, batch, weight_bytes, first, step in measured:
        if not engine.startswith("attnkit"):
            continue
        anchor = "CTranslate2" if dtype.startswith("int8") and "CTranslate2" in anchors else "llama.cpp"
        goals = backend == "torch" and batch == 1
        absent = skipped.get(anchor, "not run") if anchor not in decoded else None
        if step is None:
            out.append(dict(workload=f"Decoding SmolLM2, batch {batch} (per token)", backend=backend, dtype=dtype,
                            attnkit_s=None, anchor=anchor, anchor_s=None, gflop=None, note=f"attnkit: {INVALID}"))
        else:
            fraction = batch / step / (batch * bytes_per_second / weight_bytes)
            out.append(dict(
                workload=f"Decoding SmolLM2, batch {batch} (per token)", backend=backend, dtype=dtype,
                attnkit_s=step / batch, anchor=anchor, anchor_s=decoded[anchor][1] if anchor in decoded else None,
                anchor_missing=absent, rate=f"{batch / step:.1f} tok/s ({fraction:.0%} of ceiling)", rate_fraction=fraction,
                gflop=None, note=f"{weight_bytes / 1e6:.1f} MB a step", peak_goal=0.7 if goals else None,
                goal=1.0 if goals and (dtype.startswith("gguf") or anchor == "CTranslate2") else None))
        prefill_anchor = anchors["llama.cpp"][0] if "llama.cpp" in anchors and batch == 1 else None
        out.append(dict(
            workload=f"Prefill, {prompt_len} tokens x batch {batch} (time to first token)", backend=backend, dtype=dtype,
            attnkit_s=first, anchor="llama.cpp", anchor_s=prefill_anchor,
            anchor_missing=None if prefill_anchor else skipped.get("llama.cpp", "not run") if "llama.cpp" not in anchors else "batch 1 only", rate=f"{batch * prompt_len / first:.0f} tok/s", gflop=None, note="",
            goal=1.5 if goals and dtype.startswith("gguf") else None))
    return out


if __name__ == "__main__":
    main()
