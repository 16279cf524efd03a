"""Sentence-embedding throughput: attnkit's `load_pretrained().encode` vs sentence-transformers, and
ONNX Runtime when it is installed (issue 41: what fast CPU embedding stacks run).

All encode the same sentences with the embedded all-MiniLM-L6-v2, batch 64, in the same run, on the
CPU, in float32 and dynamic int8 (attnkit's `dtype="int8"`; ONNX Runtime: an export of
sentence-transformers' transformer made at bench time, and its `quantize_dynamic`); sentences/s is the number of sentences over the median wall time of whole `encode` calls. The
Keras backend is attnkit's default unless KERAS_BACKEND is set.

    python benchmarks/embeddings.py [--sentences 512] [--batch-size 64] [--repeats 3] [--quick]
"""

import argparse
import os
import statistics
import sys
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402
from timing import markdown_table, median_seconds, print_rows  # noqa: E402

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
    parser.add_argument("--quick", action="store_true", help="64 sentences, one run (checks that it runs)")
    parser.add_argument("--rows", action="store_true", help="print the rows of `make bench`'s table (run.py) as JSON")
    args = parser.parse_args()
    if args.quick:
        args.sentences, args.repeats = 64, 1

    import torch
    from sentence_transformers import SentenceTransformer

    texts = sentences(args.sentences)
    encoders = {"float32": attnkit.load_pretrained(), "int8": attnkit.load_pretrained(dtype="int8")}
    reference = SentenceTransformer(encoders["float32"].path, device="cpu")
    warnings.simplefilter("ignore", UserWarning)

    # Interleaved, so that all see the same machine load.
    runs = {f"attnkit {dtype}": (lambda e=e: e.encode(texts, batch_size=args.batch_size)) for dtype, e in encoders.items()}
    runs["sentence-transformers float32"] = lambda: reference.encode(texts, batch_size=args.batch_size, convert_to_numpy=True)
    onnx = {dtype: onnx_runtime_encoder(reference, args.batch_size, int8=dtype == "int8") for dtype in encoders}
    for dtype, run in onnx.items():
        if run is not None:
            runs[f"ONNX Runtime {dtype}"] = lambda run=run: run(texts)
    times = {name: [] for name in runs}
    for name, run in runs.items():
        run()  # warm-up: compilation, caches
    for _ in range(args.repeats):
        for name, run in runs.items():
            times[name].append(median_seconds(run, warmup=0, repeats=1))
    seconds = {name: statistics.median(t) for name, t in times.items()}
    theirs = seconds["sentence-transformers float32"]

    n = len(texts)
    print(f"{n} sentences, batch {args.batch_size}, {torch.get_num_threads()} torch threads, "
          f"Keras backend {keras.backend.backend()}; median of {args.repeats} runs\n")
    print(markdown_table(
        ["encoder", "seconds", "sentences/s", "vs sentence-transformers"],
        [[name, f"{s:.2f}", f"{n / s:.1f}", f"{theirs / s:.2f}x"] for name, s in seconds.items()],
    ))
    exact = reference.encode(texts[:64], convert_to_numpy=True)
    print(f"\nmax abs difference of attnkit float32's embeddings from sentence-transformers' (first 64): "
          f"{np.abs(encoders['float32'].encode(texts[:64]) - exact).max():.1e}")
    for dtype in encoders:
        ours = encoders[dtype].encode(texts[:64])
        line = f"{dtype}: attnkit's cosine with sentence-transformers float32, min {_cosine(ours, exact).min():.4f}"
        if onnx[dtype] is None:
            print(line + "; ONNX Runtime not installed (pip install onnxruntime onnx), row skipped")
            continue
        ort = onnx[dtype](texts[:64])
        print(line + f", ONNX Runtime's {_cosine(ort, exact).min():.4f}; attnkit is "
              f"{seconds[f'ONNX Runtime {dtype}'] / seconds[f'attnkit {dtype}']:.2f}x ONNX Runtime's speed")
    if args.rows:
        print_rows([dict(
            workload=f"Sentence embeddings, all-MiniLM-L6-v2, {n} sentences, batch {args.batch_size}",
            backend=keras.backend.backend(), dtype=dtype, attnkit_s=seconds[f"attnkit {dtype}"], anchor=f"ONNX Runtime {dtype}",
            anchor_s=seconds.get(f"ONNX Runtime {dtype}"), anchor_missing="onnxruntime not installed",
            rate=f"{n / seconds[f'attnkit {dtype}']:.0f} sentences/s", gflop=None, note="",
            goal=1.0 if keras.backend.backend() == "torch" else None) for dtype in encoders])


def _cosine(a, b):
    """Row-wise cosine similarity of (n, d) arrays."""
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def onnx_runtime_encoder(reference, batch_size, int8=False):
    """texts -> normalised mean-pooled embeddings (n, 384) by ONNX Runtime, from an ONNX export made now
    of sentence-transformers' own transformer (what fastembed / optimum run), or None without
    onnxruntime. Tokenization is sentence-transformers' tokenizer, as in its own encode. `int8`: the
    export through ONNX Runtime's `quantize_dynamic` (int8 weights, activations quantized per call)."""
    try:
        import onnxruntime
    except ImportError:
        return None
    import tempfile

    import torch

    transformer, tokenizer = reference[0].auto_model.eval(), reference.tokenizer
    path = os.path.join(tempfile.mkdtemp(), "minilm.onnx")
    sample = tokenizer(["a sentence", "another one"], padding=True, return_tensors="pt")
    class Hidden(torch.nn.Module):  # the transformer's last hidden state, its inputs by name
        def __init__(self):
            super().__init__()
            self.transformer = transformer  # a submodule: its weights export as weights

        def forward(self, input_ids, attention_mask, token_type_ids):
            out = self.transformer(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
            return out.last_hidden_state

    with torch.no_grad():
        torch.onnx.export(
            Hidden(), (sample["input_ids"], sample["attention_mask"], sample["token_type_ids"]), path,
            input_names=["input_ids", "attention_mask", "token_type_ids"], output_names=["last_hidden_state"],
            dynamic_axes={name: {0: "batch", 1: "tokens"} for name in ("input_ids", "attention_mask", "token_type_ids")},
            opset_version=17, dynamo=False,
        )
    if int8:
        from onnxruntime.quantization import QuantType, quantize_dynamic

        quantize_dynamic(path, path.replace(".onnx", "_int8.onnx"), weight_type=QuantType.QInt8)
        path = path.replace(".onnx", "_int8.onnx")
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    session = onnxruntime.InferenceSession(path, options, providers=["CPUExecutionProvider"])

    def encode(texts):
        out = []
        for i in range(0, len(texts), batch_size):
            batch = tokenizer(texts[i : i + batch_size], padding=True, truncation=True, max_length=256, return_tensors="np")
            inputs = {k: batch[k].astype(np.int64) for k in ("input_ids", "attention_mask", "token_type_ids")}
            hidden = session.run(None, inputs)[0]  # (B, T, 384)
            mask = inputs["attention_mask"][..., None].astype(np.float32)
            pooled = (hidden * mask).sum(1) / np.maximum(mask.sum(1), 1e-9)
            out.append(pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12))
        return np.concatenate(out)

    return encode


if __name__ == "__main__":
    main()
