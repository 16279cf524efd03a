"""The workloads of `run.py`: attnkit and its anchor timed in turn in this process, on this backend.

Every function returns a list of rows, dicts with: workload, backend, dtype, attnkit_s, anchor,
anchor_s, gflop (floating-point work of one call, in 1e9 multiply-adds x 2), note. The anchors are
PyTorch modules (whatever the Keras backend) or Keras's own layers on the current backend.

Legend: B batch, T length, h heads, d_k per-head width, D (d_model), d_ff inner width, n layers.
"""

import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(__file__))

import attnkit  # noqa: E402,F401  (chooses the Keras backend before keras is imported)
import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from baselines import BACKEND, TorchSeq2Seq, row  # noqa: E402
from demo_speed import time_to_target  # noqa: E402
from embeddings import sentences  # noqa: E402
from timing import interleaved_medians  # noqa: E402

from attnkit.dates.task import CharTokenizer, train_validation_split  # noqa: E402
from attnkit.dates.translator import TrainConfig, build_model, make_arrays  # noqa: E402

# Each workload keeps taking interleaved rounds for at least this many seconds per requested round
# (12 s for `make bench`'s 3 rounds), so that a fast workload's median is of ~15-25 samples, not 3.
SECONDS_PER_ROUND = 4.0


def medians(runs, rounds, **options):
    """`interleaved_medians` of `runs` over at least `rounds` rounds and SECONDS_PER_ROUND * rounds seconds."""
    return interleaved_medians(runs, rounds=rounds, min_seconds=SECONDS_PER_ROUND * rounds, **options)


def layer_gflop(B, T_q, T_k, D, d_ff, attentions=1):
    """Forward GFLOP of one Transformer layer: 4 projections and the scores/weights matmuls per
    attention, then the feed-forward network."""
    attention = 2 * B * T_q * D * D * 2 + 2 * B * T_k * D * D * 2 + 4 * B * T_q * T_k * D
    return (attentions * attention + 4 * B * T_q * D * d_ff) / 1e9


def keras_forward_backward(layer, x, n_inputs=1):
    """fn() running forward and backward of `layer(x, ..., x)` (`n_inputs` times x) as a user of this
    backend would: eager autograd on torch, a `tf.function` with a GradientTape on tensorflow,
    `jax.jit(jax.grad)` of a stateless call on jax. Gradients w.r.t. the weights and x."""
    if BACKEND == "torch":
        x = torch.as_tensor(x).requires_grad_(True)
        return lambda: layer(*[x] * n_inputs).sum().backward()
    if BACKEND == "tensorflow":
        import tensorflow as tf

        x = tf.constant(x)

        @tf.function
        def tf_step():
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = tf.reduce_sum(layer(*[x] * n_inputs))
            return tape.gradient(loss, [x] + layer.trainable_variables)

        return lambda: tf_step()[0].numpy()
    import jax

    trainable = [v.value for v in layer.trainable_variables]
    others = [v.value for v in layer.non_trainable_variables]

    def loss(trainable, x):
        return jax.numpy.sum(layer.stateless_call(trainable, others, *[x] * n_inputs)[0])

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    x = jax.numpy.asarray(x)
    return lambda: jax.block_until_ready(grad(trainable, x))


def keras_inference(fn, x):
    """fn() running `fn(x)` for inference as each backend does it best: eagerly under `torch.no_grad()`
    on torch (as Keras's own `predict` and the torch anchors run), compiled on jax (`jax.jit`, the
    weights captured as constants) and tensorflow (`tf.function`)."""
    if BACKEND == "torch":
        x = torch.as_tensor(x)

        def run():
            with torch.no_grad():
                return fn(x)

        return run
    if BACKEND == "tensorflow":
        import tensorflow as tf

        compiled, x = tf.function(fn), tf.constant(x)
        return lambda: compiled(x).numpy()
    import jax

    compiled, x = jax.jit(fn), jax.numpy.asarray(x)
    return lambda: jax.block_until_ready(compiled(x))


def mha(rounds):
    """MultiHeadAttention forward+backward, B=32, T=128, D=512, h=8, float32."""
    B, T, D, h = 32, 128, 512, 8
    x = np.random.default_rng(0).normal(size=(B, T, D)).astype("float32")
    ours = attnkit.MultiHeadAttention(h, D // h, D // h, D)
    theirs_keras = keras.layers.MultiHeadAttention(num_heads=h, key_dim=D // h)
    ours(x), theirs_keras(x, x)
    theirs_torch = torch.nn.MultiheadAttention(D, h, batch_first=True)
    xt = torch.from_numpy(x).requires_grad_(True)

    def torch_step():
        theirs_torch(xt, xt, xt, need_weights=False)[0].sum().backward()

    times = medians({
        "attnkit": keras_forward_backward(ours, x),
        "torch": torch_step,
        "keras": keras_forward_backward(theirs_keras, x, n_inputs=2),
    }, rounds)
    gflop = 3 * layer_gflop(B, T, T, D, 0)  # backward ~ twice the forward
    name = f"MHA fwd+bwd B={B} T={T} d_model={D} h={h}"
    return [row(name, "float32", times["attnkit"], "torch.nn.MultiheadAttention", times["torch"], gflop, goal=1.0),
            row(name, "float32", times["attnkit"], f"keras.layers.MultiHeadAttention ({BACKEND})", times["keras"], gflop,
                goal=1.1)]


def encoder(rounds, policy):
    """Encoder inference, n=6, D=512, h=8, d_ff=2048, B=16, T=128, vs torch.nn.TransformerEncoder."""
    B, T, D, h, d_ff, n = 16, 128, 512, 8, 2048, 6
    x = np.random.default_rng(0).normal(size=(B, T, D)).astype("float32")
    keras.config.set_dtype_policy(policy)
    try:
        ours = attnkit.Encoder(100, T, h, D // h, D // h, D, d_ff, n, 0.1)
        ours.build((B, T))
    finally:
        keras.config.set_dtype_policy("float32")
    layer = torch.nn.TransformerEncoderLayer(D, h, d_ff, dropout=0.1, batch_first=True)
    theirs = torch.nn.TransformerEncoder(layer, n, enable_nested_tensor=False).eval()
    xt = torch.from_numpy(x)
    half = policy == "mixed_bfloat16"

    def torch_run():
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=half):
            theirs(xt)

    run = keras_inference(lambda x: ours.encode(x, training=False), x)
    times = medians({"attnkit": run, "torch": torch_run}, rounds)
    anchor = "torch.nn.TransformerEncoder (eval, no_grad" + (", autocast bf16)" if half else ")")
    note = "attnkit: encoder.encode(x, training=False)" + (
        " under torch.no_grad()" if BACKEND == "torch" else ", compiled")
    return [row(f"Encoder inference n={n} B={B} T={T} d_model={D}", "bfloat16" if half else "float32",
                times["attnkit"], anchor, times["torch"], n * layer_gflop(B, T, T, D, d_ff), note,
                goal=1.1 if half else (1.05 if BACKEND == "torch" else 1.0), peak_goal=0.7 if half else 0.8)]


def training_step(rounds):
    """One train_on_batch of the demo model (batch 128) vs the same architecture in PyTorch, AdamW."""

    config, tokenizer, batch = TrainConfig(), CharTokenizer(), 128
    pairs, _ = train_validation_split(batch, 1, seed=0)
    source, dec_in, dec_out, weights = make_arrays(pairs, tokenizer, config.source_length)
    keras.utils.set_random_seed(0)
    model = build_model(config, tokenizer)
    model.compile(optimizer=keras.optimizers.AdamW(config.learning_rate),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    theirs = TorchSeq2Seq(tokenizer.vocab_size, config.d_model, config.h, config.d_ff, config.n, config.rate,
                          config.source_length, tokenizer.PAD).train()
    optimizer = torch.optim.AdamW(theirs.parameters(), lr=config.learning_rate)
    src, tgt_in, tgt_out, w = (torch.from_numpy(np.asarray(a)) for a in (source, dec_in, dec_out, weights))
    src, tgt_in, tgt_out = src.long(), tgt_in.long(), tgt_out.long()

    def torch_step():
        optimizer.zero_grad()
        logits = theirs(src, tgt_in)
        losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), tgt_out, reduction="none")
        ((losses * w).sum() / w.numel()).backward()
        optimizer.step()

    times = medians({
        "attnkit": lambda: model.train_on_batch((source, dec_in), dec_out, sample_weight=weights),
        "torch": torch_step,
    }, max(rounds, 3), warmup=3)
    S, T, D, d_ff, n = config.source_length, dec_in.shape[1], config.d_model, config.d_ff, config.n
    forward = n * layer_gflop(batch, S, S, D, d_ff) + n * (
        layer_gflop(batch, T, T, D, d_ff) + layer_gflop(batch, T, S, D, 0)) + 2 * batch * T * D * tokenizer.vocab_size / 1e9
    return [row(f"Train step, demo model (d_model={D}, n={n}), batch {batch}", "float32", times["attnkit"],
                "nn.Transformer + AdamW", times["torch"], 3 * forward, "model.train_on_batch")]


def embeddings(rounds, policy="float32"):
    """Pretrained all-MiniLM-L6-v2 sentence embeddings, 256 sentences, batch 64, vs sentence-transformers
    (under `torch.autocast` for bfloat16, attnkit loaded under the `mixed_bfloat16` policy)."""
    from sentence_transformers import SentenceTransformer

    texts, batch = sentences(256), 64
    half = policy == "mixed_bfloat16"
    keras.config.set_dtype_policy(policy)
    try:
        ours = attnkit.load_pretrained()
    finally:
        keras.config.set_dtype_policy("float32")
    theirs = SentenceTransformer(ours.path, device="cpu")
    warnings.simplefilter("ignore", UserWarning)

    def theirs_encode():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=half):
            theirs.encode(texts, batch_size=batch, convert_to_numpy=True)

    times = medians({"attnkit": lambda: ours.encode(texts, batch_size=batch), "torch": theirs_encode}, rounds)
    _, mask, _ = ours.tokenize(texts)
    lengths = np.sort(mask.sum(axis=1))[::-1]
    D, d_ff, n = 384, 1536, 6
    gflop = sum(n * layer_gflop(len(chunk), int(chunk[0]), int(chunk[0]), D, d_ff)
                for chunk in (lengths[i:i + batch] for i in range(0, len(lengths), batch)))
    return [row(f"MiniLM-L6 embeddings, {len(texts)} sentences, batch {batch}", "bfloat16" if half else "float32",
                times["attnkit"], "sentence-transformers" + (" (autocast bf16)" if half else ""), times["torch"], gflop,
                goal=1.1 if half else 1.0)]


def encoder_families(rounds, count=256, d_model=384, n=6, batch=64):
    """DistilBERT, RoBERTa and ELECTRA sentence embeddings (random weights, MiniLM's sizes and
    tokenizer, mean pooling) vs sentence-transformers on the same directory: the families the
    MiniLM row (BERT) does not cover."""
    import tempfile

    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules.transformer import Transformer
    from sentence_transformers.sentence_transformer.modules.pooling import Pooling

    texts = sentences(count)
    sizes = dict(vocab_size=30522, max_position_embeddings=512)
    configs = {
        "DistilBERT": transformers.DistilBertConfig(dim=d_model, n_layers=n, n_heads=12, hidden_dim=4 * d_model, **sizes),
        "RoBERTa": transformers.RobertaConfig(hidden_size=d_model, num_hidden_layers=n, num_attention_heads=12,
                                              intermediate_size=4 * d_model, pad_token_id=0, type_vocab_size=1,
                                              **{**sizes, "max_position_embeddings": 514}),
        "ELECTRA": transformers.ElectraConfig(embedding_size=d_model // 2, hidden_size=d_model, num_hidden_layers=n,
                                              num_attention_heads=12, intermediate_size=4 * d_model, **sizes),
    }
    tokenizer = transformers.AutoTokenizer.from_pretrained(attnkit.load_pretrained().path, model_max_length=256)
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for name, config in configs.items():
            base, directory = os.path.join(root, name), os.path.join(root, name + "-st")
            transformers.AutoModel.from_config(config).save_pretrained(base)
            tokenizer.save_pretrained(base)
            transformer = Transformer(base)
            SentenceTransformer(modules=[transformer, Pooling(d_model, "mean")], device="cpu").save(directory)
            ours, theirs = attnkit.load_pretrained(directory), SentenceTransformer(directory, device="cpu")
            warnings.simplefilter("ignore", UserWarning)
            times = medians({
                "attnkit": lambda: ours.encode(texts, batch_size=batch),
                "torch": lambda: theirs.encode(texts, batch_size=batch, convert_to_numpy=True),
            }, rounds)
            _, mask, _ = ours.tokenize(texts)
            lengths = np.sort(mask.sum(axis=1))[::-1]
            gflop = sum(n * layer_gflop(len(chunk), int(chunk[0]), int(chunk[0]), d_model, 4 * d_model)
                        for chunk in (lengths[i:i + batch] for i in range(0, len(lengths), batch)))
            rows.append(row(f"{name} embeddings (d_model={d_model}, n={n}), {len(texts)} sentences, batch {batch}",
                            "float32", times["attnkit"], "sentence-transformers", times["torch"], gflop,
                            "random weights"))
    return rows


def demo_time_to_99(rounds):
    """Training seconds of the demo until 99% exact match, vs a plain-PyTorch loop (`demo_speed.py`)."""
    return time_to_target(rounds)


WORKLOADS = {
    "mha": mha,
    "encoder-float32": lambda rounds: encoder(rounds, "float32"),
    "encoder-bfloat16": lambda rounds: encoder(rounds, "mixed_bfloat16"),
    "training-step": lambda rounds: training_step(rounds),
    "embeddings": lambda rounds: embeddings(max(2, rounds // 2)),
    "embeddings-bfloat16": lambda rounds: embeddings(max(2, rounds // 2), "mixed_bfloat16"),
    "encoder-families": lambda rounds: encoder_families(max(2, rounds // 2)),
    "demo-time-to-99": lambda rounds: demo_time_to_99(max(1, rounds - 1)),
}


def all_rows(rounds, names=tuple(WORKLOADS)):
    """The rows of the workloads `names` (default all), each one's wall time reported on stderr."""
    import time

    rows = []
    for name in names:
        t0 = time.perf_counter()
        try:
            rows += WORKLOADS[name](rounds)
        except Exception as e:  # noqa: BLE001 - one failed workload (a missing anchor, say) is one row
            rows.append(dict(workload=f"({name}: failed: {type(e).__name__}: {e})", backend=BACKEND, dtype="",
                             attnkit_s=None, anchor="", anchor_s=None, gflop=None, note=""))
        print(f"[{BACKEND}] {name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return rows
