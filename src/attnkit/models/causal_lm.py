"""`CausalLM`: a decoder-only language model (Llama, Mistral, Qwen2, Qwen3, Gemma, Phi-3 families) of
attnkit's layers.

    x_0 = Embedding(tokens) [* embedding_scale];  x_l = DecoderOnlyLayer_l(x_{l-1}), l = 1..n;
    logits = RMSNorm(x_n) W_vocab

W_vocab is the embedding matrix transposed when the embeddings are tied (SmolLM2), else its own
projection. Positions are those of the real tokens (left padding takes none, as in transformers),
and the rotary angles are computed from them.

Legend: B batch, T tokens in this call, S keys (cached and new), V vocabulary, d_model width,
n layers, h / h_kv heads, d_k per-head width.
"""

import numbers
import types

import keras
import numpy as np
from keras import ops

from attnkit._validation import boolean, optional_positive_int, positive_float, positive_int
from attnkit.layers._call_checks import CheckedCall
from attnkit.layers._policies import SublayerPolicies
from attnkit.layers._sublayer import call_sublayer
from attnkit.layers._token_ids import check_token_ids, concrete_values as _concrete_values
from attnkit.layers.decoder_only_layer import DecoderOnlyLayer
from attnkit.layers.linear import Linear
from attnkit.layers.kv_cache import KVCache, keep_mask
from attnkit.layers.position_embedding import embedding_table
from attnkit.layers.rms_norm import RMSNorm, check_norm_offset
from attnkit.layers.swiglu import gate_activation
from attnkit.models import _torch_decoding
from attnkit import kernels
from attnkit.ops.masks import check_mask_dtype
from attnkit.ops.rotary import check_rope_scaling, rotary_cos_sin


def _host_mask(attention_mask, shape):
    """The (B, T) attention mask as a NumPy bool array, all True when None.

    The mask is Hugging Face's `attention_mask`: bool, or integers 0 (padding) and 1 (a real token).
    A float mask is refused, as everywhere in attnkit (README, "The mask convention"): HF's additive
    masks (0 keep, a large negative number hide) would read inverted, and 0.5 has no meaning. Integers other than 0 and 1
    are refused too: the mask places positions and cache slots, and transformers' `generate` counts a
    2 as two positions (docs/decisions.md item 105).

    Positions, keep-masks and cache slots are worked out on the host from the mask's values, which a
    mask traced by jax.jit or tf.function does not have: refused by name (NumPy's conversion failed
    there with errors naming neither the argument nor the way out)."""
    if attention_mask is None:
        return np.ones(shape, bool)
    dtype = check_mask_dtype(attention_mask, "attention_mask")  # static: refused under jit too
    values = _concrete_values(attention_mask) if ops.is_tensor(attention_mask) else ops.convert_to_numpy(attention_mask)
    if values is None:
        raise ValueError(
            "`CausalLM` needs the values of `attention_mask` on the host: it places positions and cache slots "
            "there. Pass it as a concrete array (NumPy), or call the model outside jax.jit / tf.function "
            f"(token ids alone may be traced). Received: attention_mask, a traced tensor of shape {tuple(attention_mask.shape)}"
        )
    values = np.asarray(values)
    if dtype != "bool" and not np.isin(values, (0, 1)).all():
        raise ValueError(
            "`attention_mask` must hold 1 for real tokens and 0 for (left) padding, or True / False, as Hugging "
            "Face's attention_mask does. Received: attention_mask with values such as "
            f"{np.unique(values[~np.isin(values, (0, 1))])[:3].tolist()}"
        )
    return values.astype(bool)


@keras.saving.register_keras_serializable(package="attnkit")
class CausalLM(CheckedCall, SublayerPolicies, keras.Model):
    """A decoder-only Transformer with RoPE, grouped-query attention, RMSNorm and SwiGLU.

    Args:
        vocab_size: V.
        n: number of layers.
        d_model: width.
        h: query heads.
        d_ff: feed-forward inner width.
        num_kv_heads: key/value heads. Default h.
        d_k: per-head width. Default d_model // h.
        rope_theta: the rotary base. Default 10000.
        rope_scaling: None or {"rope_type": "default"}; other variants are refused by name.
        epsilon: RMSNorm epsilon. Default 1e-6.
        tie_embeddings: project to the vocabulary with the embedding matrix. Default True.
        attention_bias, output_bias, mlp_bias: biases on W_q/W_k/W_v, W_o, the feed-forward.
        sliding_windows: None, an int for every layer, or a list of n entries (int or None).
        activation: the feed-forward gate's, "silu" (default) or "gelu_tanh" (Gemma).
        norm_offset: 0 (default), or 1 for RMSNorms scaling by 1 + gamma (Gemma).
        qk_norm: RMSNorms over each head's queries and keys (Qwen3). Default False.
        embedding_scale: None (default), or a number the embeddings are multiplied by in the compute
            dtype (Gemma: sqrt(d_model)).
        **kwargs: `keras.Model` arguments (name, dtype, ...).

    Call arguments:
        token_ids: (B, T) integer ids.
        attention_mask: optional (B, T) bool, or integers 0 / 1: 0 on (left) padding. Default all ones.
            Float masks and other integers are refused (docs/decisions.md item 105).
        cache: optional `KVCache` (from `new_cache`); the T tokens follow the cached ones.
        last_only: return the logits of the last position only, (B, 1, V). Default False.
        attention_layer: optional layer index whose attention weights (B, h, T, S) to return too, or
            "all" for a list of every layer's (the explorer's view of cached decoding).
        training: Keras's flag. Compiled with a loss that projects (`loss_projects`), a training call
            without a cache returns the final hidden states instead of the logits (below).

    Returns:
        logits (B, T, V) in float32 (or (B, 1, V)), and the weights when `attention_layer` is given.
        With `loss_projects` (compiled by `attnkit.finetune.training.prepare`) and `training=True`, as
        Keras's `fit` and `train_on_batch` call it: the normed hidden states (B, T, d_model), which the
        loss projects with `logits_of`, only at the tokens it learns where the backend allows a
        shape known at run time (docs/decisions.md item 160).

    Raises:
        ValueError: bad sizes, an unimplemented RoPE scaling, token ids of the wrong rank, a cache
            too small.

    Example:
    >>> lm = CausalLM(vocab_size=100, n=2, d_model=64, h=4, d_ff=128, num_kv_heads=2)
    >>> lm(ops.ones((1, 5), "int32")).shape  # (1, 5, 100)
    """

    # `last_only` reaches `call` as a Python bool: "false" would be truthy (docs/decisions.md item 84).
    _call_checks = dict(flags=("last_only",))

    def __init__(
        self, vocab_size, n, d_model, h, d_ff, *, num_kv_heads=None, d_k=None, rope_theta=10000.0, rope_scaling=None,
        epsilon=1e-6, tie_embeddings=True, attention_bias=False, output_bias=False, mlp_bias=False,
        sliding_windows=None, activation="silu", norm_offset=0.0, qk_norm=False, embedding_scale=None, **kwargs,
    ):
        super().__init__(**kwargs)
        self.vocab_size, self.n = positive_int("vocab_size", vocab_size), positive_int("n", n)
        self.d_model, self.h, self.d_ff = positive_int("d_model", d_model), positive_int("h", h), positive_int("d_ff", d_ff)
        self.num_kv_heads = self.h if num_kv_heads is None else positive_int("num_kv_heads", num_kv_heads)
        if d_k is None and self.d_model < self.h:  # d_k = d_model // h would be 0: name what was given
            raise ValueError(
                f"`d_model` must be at least `h` when `d_k` is not given (d_k = d_model // h). "
                f"Received: d_model={self.d_model}, h={self.h}"
            )
        self.d_k = self.d_model // self.h if d_k is None else positive_int("d_k", d_k)
        self.rope_theta = positive_float("rope_theta", rope_theta)
        self.rope_scaling = rope_scaling
        check_rope_scaling(rope_scaling)
        self.epsilon = positive_float("epsilon", epsilon)
        self.tie_embeddings = bool(boolean("tie_embeddings", tie_embeddings))
        # bool("false") is True: a flag is a bool, NumPy's or 0/1, nothing truthy (docs/decisions.md item 84).
        self.attention_bias = bool(boolean("attention_bias", attention_bias))
        self.output_bias = bool(boolean("output_bias", output_bias))
        self.mlp_bias = bool(boolean("mlp_bias", mlp_bias))
        if sliding_windows is None or isinstance(sliding_windows, (numbers.Number, np.bool_)):
            sliding_windows = [sliding_windows] * self.n  # one for every layer; each entry is checked below
        if not isinstance(sliding_windows, (list, tuple)) or len(sliding_windows) != self.n:
            raise ValueError(
                f"`sliding_windows` must be None, a positive integer or a list of n={self.n} entries (each a positive "
                f"integer or None). Received: sliding_windows={sliding_windows!r}"
            )
        self.sliding_windows = [optional_positive_int("sliding_windows", w) for w in sliding_windows]
        self.activation = gate_activation("activation", activation)
        self.norm_offset = check_norm_offset("norm_offset", norm_offset)
        self.qk_norm = bool(boolean("qk_norm", qk_norm))
        self.embedding_scale = None if embedding_scale is None else positive_float("embedding_scale", embedding_scale)
        policy = self.dtype_policy
        self.embedding = keras.layers.Embedding(self.vocab_size, self.d_model, name="embedding", dtype=policy)
        self.decoder_layers = [
            DecoderOnlyLayer(
                self.h, self.d_k, self.d_model, self.d_ff, num_kv_heads=self.num_kv_heads, epsilon=self.epsilon,
                attention_bias=self.attention_bias, output_bias=self.output_bias, mlp_bias=self.mlp_bias,
                sliding_window=w, activation=self.activation, norm_offset=self.norm_offset, qk_norm=self.qk_norm,
                name=f"layer_{i}", dtype=policy,
            )
            for i, w in enumerate(self.sliding_windows)
        ]
        self.final_norm = RMSNorm(epsilon=self.epsilon, offset=self.norm_offset, name="final_norm", dtype=policy)
        self.lm_head = None if self.tie_embeddings else Linear(self.vocab_size, use_bias=False, name="lm_head", dtype=policy)
        self._compiled = None  # the compiled cached call on jax and tensorflow and its variables' key, made at first use
        self._torch_decoding_plan = None  # torch: what `_torch_decoding` reads, looked up at first use

    def build(self, token_ids_shape=None, *args, **kwargs):
        shape = (None, None, self.d_model)
        self.embedding.build((None, None))
        for layer in self.decoder_layers:
            layer.build(shape)
        self.final_norm.build(shape)
        if self.lm_head is not None:
            self.lm_head.build(shape)
        self.built = True

    def new_cache(self, batch, max_length):
        """An empty `KVCache` for `batch` sequences of up to `max_length` tokens."""
        return KVCache(
            self.n, positive_int("batch", batch), self.num_kv_heads, positive_int("max_length", max_length), self.d_k,
            self.compute_dtype,
        )

    def call(self, token_ids, attention_mask=None, cache=None, last_only=False, attention_layer=None, training=None):
        # Out-of-range ids are refused here, before the cache's bookkeeping moves: jax's lookup would
        # clamp them without a word.
        token_ids = check_token_ids(token_ids, self.vocab_size, float("inf"), "token_ids")  # (B, T)
        if attention_layer == "all":
            wanted = range(self.n)
        elif attention_layer is None or (
            isinstance(attention_layer, int) and not isinstance(attention_layer, bool) and 0 <= attention_layer < self.n
        ):
            wanted = () if attention_layer is None else (attention_layer,)
        else:
            raise ValueError(
                f"`attention_layer` must be None, a layer index in [0, {self.n}) or \"all\". Received: attention_layer={attention_layer!r}"
            )
        B, T = token_ids.shape
        if B is None or T is None:
            # Positions, masks and the cache's slots are worked out on the host from the shape: a
            # tf.function traced for any batch (tensorflow's fit/predict/evaluate) cannot give them.
            raise ValueError(
                "`CausalLM` needs `token_ids` of a known shape: it places positions and cache slots on the "
                "host. Call the model directly, or compile it with `run_eagerly=True` before fit, predict or "
                f"evaluate. Received: token_ids.shape={tuple(token_ids.shape)}"
            )
        valid_new = _host_mask(attention_mask, (B, T))
        if valid_new.shape != (B, T):
            raise ValueError(
                f"`attention_mask` must have the shape of `token_ids`, {(B, T)}. Received: attention_mask.shape={valid_new.shape}"
            )
        if cache is None:
            cache_view = KVCache.__new__(KVCache)  # bookkeeping only: no buffers for an uncached call
            cache_view.length, cache_view.max_length = 0, T
            cache_view.valid, cache_view.seen = np.zeros((B, T), bool), np.zeros((B,), "int64")
            positions, start, valid = cache_view.advance(valid_new), 0, valid_new
        else:
            start = cache.length
            positions = cache.advance(valid_new)
            valid = cache.valid[:, : cache.attended]  # (B, S)
        cos, sin = rotary_cos_sin(positions, self.d_k, self.rope_theta)  # (B, 1, T, d_k) each, float32
        query_slots = np.arange(start, start + T)
        masks = {w: keep_mask(valid, query_slots, w) for w in set(self.sliding_windows)}  # (keep, causal) each
        keeps = tuple(masks[w][0] for w in self.sliding_windows)  # per layer: (B, 1, T, S) or None
        causals = tuple(masks[w][1] for w in self.sliding_windows)
        if cache is not None and not wanted:
            if keras.backend.backend() in ("jax", "tensorflow"):
                return self._compiled_call(token_ids, cos, sin, keeps, causals, cache, start, last_only)
            logits = _torch_decoding.forward(self, token_ids, cos, sin, keeps, causals, cache, start, last_only)
            if logits is not None:
                return logits
        hidden_only = bool(training) and self.loss_projects and cache is None and not wanted and not last_only
        logits, weights = self._forward(token_ids, cos, sin, keeps, causals, cache, start, last_only, wanted, hidden_only)
        if attention_layer is None:
            return logits
        if cache is not None and cache.attended != cache.length:
            weights = [w[..., : cache.length] for w in weights]  # (B, h, T, S): the filled slots only
        return logits, (weights if attention_layer == "all" else weights[0])

    def _forward(self, token_ids, cos, sin, keeps, causals, cache, start, last_only, wanted=(), hidden_only=False):
        """The layers, after `call` did the bookkeeping on the host: logits (B, T or 1, V) float32 (the
        normed hidden states (B, T, d_model) with `hidden_only`) and the weights of the layers in
        `wanted`. Every input is a tensor or fixed by the call's shapes, so jax can compile it
        (`_compiled_call`)."""
        x = self.embed(self.embedding(token_ids))  # (B, T, d_model)
        weights = []
        for i, layer in enumerate(self.decoder_layers):
            want = i in wanted
            x = call_sublayer(
                layer, x, cos, sin, keeps[i], causal=causals[i], cache=cache, layer_index=i, start=start,
                return_attention_weights=want,
            )
            if want:
                x, w = x
                weights.append(w)
        if last_only:
            x = x[:, -1:]  # (B, 1, d_model)
        x = call_sublayer(self.final_norm, x)
        return (x if hidden_only else self.logits_of(x)), weights

    @property
    def loss_projects(self):
        """Whether a training call returns the hidden states: the model is compiled with a loss that
        projects them itself (`TokenLoss(head=self)`) and no metrics (Keras hands a step's
        predictions to its metrics too), and d_model != V tells them from logits. Compiled otherwise,
        the model gives its loss and metrics the logits."""
        return (getattr(getattr(self, "loss", None), "head", None) is self and self.d_model != self.vocab_size
                and getattr(self, "_compile_metrics", None) is None)

    def logits_of(self, x):
        """The logits (..., V) float32 of normed hidden states x (..., d_model) in the compute dtype:
        x W_vocab, W_vocab the embedding matrix transposed when tied."""
        if self.lm_head is None:
            logits = kernels.times_transposed(x, embedding_table(self.embedding, x.dtype))  # (..., V)
        else:
            logits = call_sublayer(self.lm_head, x)
        return ops.cast(logits, "float32")

    def embed(self, x):
        """The looked-up embeddings x (B, T, d_model) times `embedding_scale` in x's dtype (Gemma's
        sqrt(d_model), rounded to the model's dtype as transformers rounds it), or x itself."""
        if self.embedding_scale is None:
            return x
        return x * ops.cast(self.embedding_scale, x.dtype)  # (B, T, d_model)

    def _compiled_call(self, token_ids, cos, sin, keeps, causals, cache, start, last_only):
        """jax and tensorflow: a cached call as one compiled program (`jax.jit`, `tf.function`), the cache's
        buffers its arguments and results.

        Eagerly, each of a step's ~1000 operations is dispatched on its own, several times the step's
        arithmetic at batch 1 (docs/performance.md). One program is traced per shape of the new tokens
        and of the cache (the prefill, then every step alike: the cache attends to all its slots on
        these backends); `start` is an argument, not a constant. jax takes the variables as arguments
        too; a tf.function reads the variables it captures.
        """
        # A program traced for other variables (before `quantize`, `enable_lora`, ...) would run the old
        # layers on the old weights without a word: it is remade when the variables change.
        variables = self.variables  # walked once a call: a step's ~700 variables, Keras's walk of the layers
        key = tuple((id(v), v.dtype, tuple(v.shape)) for v in variables)
        if self._compiled is None or self._compiled.key != key:
            if keras.backend.backend() == "jax":
                import jax

                def forward(values, token_ids, cos, sin, keeps, keys, vals, start, causals, last_only):
                    with keras.StatelessScope(state_mapping=list(zip(variables, values))):
                        view = KVCache.of_buffers(keys, vals)
                        logits, _ = self._forward(token_ids, cos, sin, keeps, causals, view, start, last_only)
                    return logits, tuple(view.keys), tuple(view.values)

                compiled = jax.jit(forward, static_argnames=("causals", "last_only"))
            else:
                import tensorflow as tf

                def forward(token_ids, cos, sin, keeps, keys, vals, start, causals, last_only):
                    view = KVCache.of_buffers(keys, vals)
                    logits, _ = self._forward(token_ids, cos, sin, keeps, causals, view, start, last_only)
                    return logits, tuple(view.keys), tuple(view.values)

                compiled = tf.function(forward)
            self._compiled = types.SimpleNamespace(key=key, run=compiled)  # a plain object: Keras does not track it
        values_now = ([v.value for v in variables],) if keras.backend.backend() == "jax" else ()
        logits, keys, values = self._compiled.run(
            *values_now, token_ids, cos, sin, keeps, tuple(cache.keys), tuple(cache.values), ops.convert_to_tensor(start, "int32"),
            causals=causals, last_only=bool(last_only),
        )
        cache.keys, cache.values = list(keys), list(values)
        return logits

    def get_config(self):
        return {
            **super().get_config(),
            "vocab_size": self.vocab_size, "n": self.n, "d_model": self.d_model, "h": self.h, "d_ff": self.d_ff,
            "num_kv_heads": self.num_kv_heads, "d_k": self.d_k, "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling, "epsilon": self.epsilon, "tie_embeddings": self.tie_embeddings,
            "attention_bias": self.attention_bias, "output_bias": self.output_bias, "mlp_bias": self.mlp_bias,
            "sliding_windows": self.sliding_windows, "activation": self.activation, "norm_offset": self.norm_offset,
            "qk_norm": self.qk_norm, "embedding_scale": self.embedding_scale,
        }
