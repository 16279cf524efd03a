"""Teach SmolLM2-135M-Instruct the date-normalisation task with LoRA, as chat:

    user: "Normalise: 3/3/21"   ->   assistant: "2021-03-03"

The data is attnkit's embedded date task (attnkit.dates.task): many surface forms of a date, the
ISO 8601 form as the answer. The script scores exact match on held-out dates before and after
fine-tuning, and times the training.

    python examples/finetune_dates.py                       # the README's run
    python examples/finetune_dates.py --train 200 --eval 50 # a quicker look

`run(...)` takes the sizes as parameters, so a test can run a smaller version.
"""

import argparse
import json
import os
import tempfile
import time

import attnkit  # noqa: F401  (chooses the Keras backend)
from attnkit.finetune import finetune
from attnkit.pipelines.causal_checkpoint import load_causal_lm
from attnkit.dates import task as dates

SYSTEM = "Answer with the date in ISO 8601 form, YYYY-MM-DD."


def chat(source):
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Normalise: {source}"}]


def split(n_train, n_eval, seed):
    """Training pairs and held-out pairs whose sources the training never saw."""
    train = dates.generate(n_train, seed)
    seen = {s for s, _ in train}
    held_out, k = [], 0
    while len(held_out) < n_eval:
        held_out += [(s, t) for s, t in dates.generate(4 * n_eval, seed + 1000 + k) if s not in seen][: n_eval - len(held_out)]
        k += 1
    return train, held_out


def exact_match(lm, pairs, batch=50):
    """The fraction of `pairs` whose greedy reply is exactly the ISO date."""
    right = 0
    for start in range(0, len(pairs), batch):
        chunk = pairs[start : start + batch]
        replies = lm.chat([chat(s) for s, _ in chunk], max_new_tokens=12, temperature=0.0)
        right += sum(r.strip() == t for r, (_, t) in zip(replies, chunk))
    return right / len(pairs)


def run(n_train=1200, n_eval=500, epochs=1, batch_size=16, rank=16, alpha=32, learning_rate=2e-3, targets="q,k,v,o,gate,up,down",
        model=None, output_dir=None, seed=0, max_length=128, log=print):
    """Fine-tunes and scores; returns {"before", "after", "train_seconds", ...}."""
    train, held_out = split(n_train, n_eval, seed)
    work = output_dir or tempfile.mkdtemp(prefix="attnkit-dates-")
    data = os.path.join(work, "train.jsonl") if output_dir is None else os.path.join(tempfile.mkdtemp(), "train.jsonl")
    with open(data, "w", encoding="utf-8") as f:
        for s, t in train:
            f.write(json.dumps({"messages": chat(s) + [{"role": "assistant", "content": t}]}) + "\n")
    out = os.path.join(work, "model") if output_dir is None else output_dir
    before = exact_match(load_causal_lm(model), held_out)
    log(f"before: exact match {before:.1%} on {n_eval} held-out dates")
    started = time.perf_counter()
    history = finetune(data, out, model=model, epochs=epochs, batch_size=batch_size, lora_rank=rank, lora_alpha=alpha,
                       learning_rate=learning_rate, lora_targets=targets, seed=seed, max_length=max_length, log=log)
    seconds = time.perf_counter() - started
    after = exact_match(load_causal_lm(out), held_out)
    log(f"after:  exact match {after:.1%} on {n_eval} held-out dates; training {seconds / 60:.1f} min "
        f"({sum(h['seconds'] for h in history) / 60:.1f} min in the training steps)")
    return {"before": before, "after": after, "train_seconds": seconds, "history": history, "output_dir": out}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--train", type=int, default=1200)
    parser.add_argument("--eval", type=int, default=500)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--targets", default="q,k,v,o,gate,up,down")
    parser.add_argument("--output-dir")
    args = parser.parse_args()
    result = run(args.train, args.eval, args.epochs, args.batch_size, args.rank, 2 * args.rank, args.learning_rate,
                 args.targets, output_dir=args.output_dir)
    print(json.dumps({k: v for k, v in result.items() if k != "history"}, indent=1))
