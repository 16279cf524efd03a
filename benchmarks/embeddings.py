"""Sentence-embedding throughput: attnkit's `load_pretrained().encode` vs sentence-transformers.

Both encode the same sentences with the embedded all-MiniLM-L6-v2, batch 64, in the same run, on the
CPU; sentences/s is the number of sentences over the median wall time of whole `encode` calls. The
Keras backend is attnkit's default unless KERAS_BACKEND is set.

    python benchmarks/embeddings.py [--sentences 512] [--batch-size 64] [--repeats 3]
"""

import argparse
import os
import statistics
import sys
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402
from timing import markdown_table, median_seconds  # noqa: E402

import attnkit  # noqa: E402  (chooses the Keras backend)
import keras  # noqa: E402

SUBJECTS = ["The cat", "A young woman", "The committee", "My neighbour's dog", "The new processor", "Our team"]
VERBS = ["quietly watched", "argued about", "completely ignored", "carefully measured", "wrote a report on"]
OBJECTS = ["the sunset over the harbour", "the budget for next year", "a strange noise in the attic",
           "the results of the experiment", "an old map of the city and its many narrow streets"]


def sentences(count, seed=0):
    """`count` English sentences of 6 to about 60 words."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        clauses = [f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}" for _ in range(rng.integers(1, 6))]
        out.append(", and ".join(clauses) + ".")
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sentences", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import torch
    from sentence_transformers import SentenceTransformer

    texts = sentences(args.sentences)
    encoder = attnkit.load_pretrained()
    reference = SentenceTransformer(encoder.path, device="cpu")
    warnings.simplefilter("ignore", UserWarning)

    # Interleaved, so that both see the same machine load.
    runs = {"attnkit": lambda: encoder.encode(texts, batch_size=args.batch_size),
            "reference": lambda: reference.encode(texts, batch_size=args.batch_size, convert_to_numpy=True)}
    times = {name: [] for name in runs}
    for name, run in runs.items():
        run()  # warm-up: compilation, caches
    for _ in range(args.repeats):
        for name, run in runs.items():
            times[name].append(median_seconds(run, warmup=0, repeats=1))
    ours, theirs = (statistics.median(times[name]) for name in runs)
    difference = np.abs(encoder.encode(texts[:64]) - reference.encode(texts[:64], convert_to_numpy=True)).max()

    n = len(texts)
    print(f"{n} sentences, batch {args.batch_size}, {torch.get_num_threads()} torch threads, "
          f"Keras backend {keras.backend.backend()}; median of {args.repeats} runs\n")
    print(markdown_table(
        ["encoder", "seconds", "sentences/s", "vs sentence-transformers"],
        [
            [f"attnkit ({keras.backend.backend()})", f"{ours:.2f}", f"{n / ours:.1f}", f"{theirs / ours:.2f}x"],
            ["sentence-transformers (torch)", f"{theirs:.2f}", f"{n / theirs:.1f}", "1.00x"],
        ],
    ))
    print(f"\nmax abs difference of the embeddings (first 64): {difference:.1e}")


if __name__ == "__main__":
    main()
