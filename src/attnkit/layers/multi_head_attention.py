"""`MultiHeadAttention`: h heads of scaled dot-product attention (paper section 3.2.2; seeds 000, 001).

    MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O,  head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V)

Legend: B batch, T_q/T_k query/key lengths, h heads, d_k/d_v per-head widths (the paper's meaning;
seed 000 uses totals), d_model output width.
"""

import keras
from keras import ops

from attnkit._validation import boolean, positive_int, rate
from attnkit.layers._call_checks import CheckedCall
from attnkit.layers._keras_mask import keras_mask_of
from attnkit.layers._policies import SublayerPolicies
from attnkit.layers._shapes import check_built_width, check_positive_widths
from attnkit.layers._sublayer import call_sublayer, in_own_scope
from attnkit.kernels.quantized import dynamic_int8
from attnkit.layers.linear import Linear, holds_blocks
from attnkit import kernels
from attnkit.ops.attention import fused_attention, scaled_dot_product_attention
from attnkit.ops.grouped_attention import grouped_query_attention
from attnkit.ops.linear import linear
from attnkit.ops.masks import shape_str, broadcast_mask, combine_masks


@keras.saving.register_keras_serializable(package="attnkit")
class MultiHeadAttention(CheckedCall, SublayerPolicies, keras.layers.Layer):
    """Multi-head attention with learned projections W_q, W_k, W_v and W_o.

    Args:
        h: number of heads.
        d_k: per-head width of the projected queries and keys (the paper's d_k = d_model / h).
        d_v: per-head width of the projected values.
        d_model: width of the output.
        dropout: dropout rate on the attention weights, in [0, 1). Default 0.
        use_bias: whether the four projections have biases. Default True.
        kernel_initializer: initializer of the projection kernels. Default "glorot_uniform".
        bias_initializer: initializer of the biases. Default "zeros".
        seed: optional int seed for the dropout.
        num_kv_heads: number of key/value heads h_kv, dividing h (keyword-only). Default h
            (multi-head attention); fewer is grouped-query attention, 1 multi-query attention
            (docs/decisions.md item 33). W_k and W_v then have h_kv * d_k and h_kv * d_v outputs.
        join_keras_mask: whether the keys' Keras mask joins an explicit `mask` when Keras filled no
            `keys_mask` (keyword-only; docs/decisions.md item 15). Default True, as in Keras; the
            encoder and decoder layers pass False, their masks already say which keys to hide.
        **kwargs: base `keras.layers.Layer` arguments (name, dtype, ...).

    Call arguments:
        queries: (B, T_q, d_q).
        keys: (B, T_k, d_kin); default `queries` (self-attention).
        values: (B, T_k, d_vin); default `keys`.
        mask: optional keep-mask, True = may attend; (T_k,), (B, T_k), (T_q, T_k), (B, T_q, T_k) or
            (B, h, T_q, T_k). Keras masks on the inputs (from `Embedding(mask_zero=True)`) are
            honoured as key padding.
        causal: also apply the bottom-right look-ahead mask. Default False.
        return_attention_weights: also return the per-head weights. Default False.
        training: whether dropout is active.

    Returns:
        output (B, T_q, d_model), and weights (B, h, T_q, T_k) when `return_attention_weights`.

    Raises:
        ValueError: non-positive sizes, ranks other than 3, mismatched batch sizes or lengths, a mask
            that does not broadcast.
        TypeError: non-integer sizes, a float mask.

    Example:
    >>> x = keras.random.normal((64, 5, 512))
    >>> MultiHeadAttention(h=8, d_k=64, d_v=64, d_model=512)(x).shape  # (64, 5, 512)

    References:
        Vaswani et al., "Attention Is All You Need", 2017, section 3.2.2.
    """

    _call_checks = dict(
        floats=("queries", "keys", "values"), masks=("mask",), flags=("causal", "return_attention_weights")
    )

    def __init__(
        self, h, d_k, d_v, d_model, *, dropout=0.0, use_bias=True, kernel_initializer="glorot_uniform",
        bias_initializer="zeros", seed=None, num_kv_heads=None, join_keras_mask=True, **kwargs,
    ):
        super().__init__(**kwargs)
        self.h = positive_int("h", h)
        self.d_k = positive_int("d_k", d_k)
        self.d_v = positive_int("d_v", d_v)
        self.d_model = positive_int("d_model", d_model)
        self.dropout = rate("dropout", dropout)
        self.use_bias = bool(boolean("use_bias", use_bias))
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.seed = seed
        self.num_kv_heads = self.h if num_kv_heads is None else positive_int("num_kv_heads", num_kv_heads)
        if self.h % self.num_kv_heads:
            raise ValueError(
                f"`num_kv_heads` must divide `h`. Received: num_kv_heads={self.num_kv_heads}, h={self.h}"
            )
        self.seed_generator = keras.random.SeedGenerator(seed) if self.dropout > 0 else None
        self.supports_masking = True
        dense = dict(
            use_bias=self.use_bias, kernel_initializer=self.kernel_initializer,
            bias_initializer=self.bias_initializer, dtype=self.dtype_policy,
        )
        self.W_q = Linear(self.h * self.d_k, name="W_q", **dense)
        self.W_k = Linear(self.num_kv_heads * self.d_k, name="W_k", **dense)
        self.W_v = Linear(self.num_kv_heads * self.d_v, name="W_v", **dense)
        self.W_o = Linear(self.d_model, name="W_o", **dense)
        self.join_keras_mask = bool(boolean("join_keras_mask", join_keras_mask))

    def build(self, queries_shape, keys_shape=None, values_shape=None):
        keys_shape = keys_shape or queries_shape
        values_shape = values_shape or keys_shape
        check_positive_widths({"queries": queries_shape, "keys": keys_shape, "values": values_shape})
        self.W_q.build(queries_shape)
        self.W_k.build(keys_shape)
        self.W_v.build(values_shape)
        self.W_o.build(tuple(queries_shape[:-1]) + (self.h * self.d_v,))

    def call(
        self, queries, keys=None, values=None, mask=None, *, causal=False, return_attention_weights=False,
        training=None, queries_mask=None, keys_mask=None, values_mask=None,
    ):
        if mask is not None and mask is keras_mask_of(queries):
            # Keras filled `mask` with the queries' own (B, T) padding mask: in self-attention, keys.
            mask, keys_mask = None, mask
        keys = queries if keys is None else keys
        values = keys if values is None else values
        self._check_inputs(queries, keys, values)
        key_padding = keys_mask if keys_mask is not None else values_mask
        if key_padding is None and self.join_keras_mask:
            # An explicit `mask` keeps Keras from filling the masks; the keys' padding still holds.
            key_padding = keras_mask_of(keys)
            key_padding = keras_mask_of(values) if key_padding is None else key_padding
        if key_padding is not None:
            scores_shape = (queries.shape[0], self.h, queries.shape[1], keys.shape[1])
            key_padding = broadcast_mask(ops.expand_dims(key_padding, 1), scores_shape)  # (B, 1, 1, T_k)
            mask = key_padding if mask is None else combine_masks(
                broadcast_mask(mask, scores_shape, query_length=ops.shape(queries)[1]), key_padding
            )

        if projection_path((self.W_q, self.W_k, self.W_v), queries is keys and keys is values) == SIDE_BY_SIDE:
            q, k, v = self._project_together(queries, (self.W_q, self.W_k, self.W_v))
        else:
            q = None  # projected by attend_projected
            k, v = self.project_keys_values(keys, values)
        return self.attend_projected(
            queries, k, v, mask, causal=causal, return_attention_weights=return_attention_weights,
            training=training, projected_queries=q,
        )

    def _project_together(self, x, projections):
        """Step 1 for projections of the same input, as one matmul with their kernels side by side:
        [W_q | W_k | W_v] in self-attention, [W_k | W_v] in cross-attention. One pass over x instead
        of several, and a larger, faster matmul; the variables stay the Dense layers' own.

        Args:
            x: (B, T, d_in).
            projections: Dense layers of this layer, each of width h * d.

        Returns:
            One (B, h, T, d) tensor per projection.
        """
        parts = project_side_by_side(x, projections, self.compute_dtype)  # (B, T, h * d) each
        return [kernels.split_heads(part, self._heads(d), d.units // self._heads(d)) for part, d in zip(parts, projections)]  # (B, h, T, d)

    @in_own_scope
    def project_keys_values(self, keys, values):
        """Step 1 for keys and values: W_k, W_v and the split into heads.

        Cached decoding keeps these (B, h, T_k, d_k) / (B, h, T_k, d_v) projections instead of
        recomputing them every step.

        Args:
            keys: (B, T_k, d_kin). values: (B, T_k, d_vin).

        Returns:
            (k, v): (B, h_kv, T_k, d_k) and (B, h_kv, T_k, d_v), h_kv = `num_kv_heads`.
        """
        self._check_built("project_keys_values")
        if projection_path((self.W_k, self.W_v), keys is values) == SIDE_BY_SIDE:
            return tuple(self._project_together(keys, (self.W_k, self.W_v)))  # the usual cross-attention
        return self._into_heads(self.W_k, keys), self._into_heads(self.W_v, values)

    @in_own_scope
    def project_queries(self, queries):
        """Step 1 for the queries: W_q and the split into heads, (B, T_q, d_q) -> (B, h, T_q, d_k).

        A layer that rotates the projected queries and keys (RoPE) projects them with this and
        `project_keys_values`, then calls `attend_projected`.
        """
        self._check_built("project_queries")
        return self._into_heads(self.W_q, queries)

    def _check_built(self, method):
        """The steps called directly read the projections' kernels: `__call__` builds them, they do not."""
        if not self.built:
            raise ValueError(
                f"`MultiHeadAttention.{method}` needs a built layer: call the layer once, or call "
                "`build(queries_shape, keys_shape, values_shape)`, first."
            )

    def _heads(self, projection):
        """The number of heads a projection's output splits into: h_kv for W_k and W_v, else h."""
        return self.num_kv_heads if projection is self.W_k or projection is self.W_v else self.h

    def _into_heads(self, projection, x):
        """One projection split into heads: (B, T, d_in) -> (B, heads, T, d)."""
        heads = self._heads(projection)
        d = projection.units // heads
        if projection_path((projection,)) == PER_HEAD:
            x = ops.cast(x, self.compute_dtype)
            return kernels.project_into_heads(x, *self._kernel_and_bias(projection), heads, d)
        return kernels.split_heads(call_sublayer(projection, x), heads, d)  # (B, T, heads * d) -> (B, heads, T, d)

    def _from_heads(self, heads):
        """Step 3 and 4: the heads side by side, projected by W_o: (B, h, T_q, d_v) -> (B, T_q, d_model)."""
        if projection_path((self.W_o,)) == PER_HEAD:
            return kernels.project_from_heads(heads, *self._kernel_and_bias(self.W_o))
        concat = kernels.merge_heads(heads)  # (B, h, T_q, d_v) -> (B, T_q, h * d_v)
        return call_sublayer(self.W_o, concat)

    def _kernel_and_bias(self, projection):
        """A Dense layer's kernel and bias (or None) in the compute dtype, as its own call would use them."""
        dtype = self.compute_dtype
        return ops.cast(projection.kernel, dtype), ops.cast(projection.bias, dtype) if self.use_bias else None

    @in_own_scope
    def attend_projected(
        self, queries, k, v, mask=None, *, causal=False, return_attention_weights=False, training=None,
        projected_queries=None,
    ):
        """Steps 1 (queries only) to 4, with keys and values already projected by `project_keys_values`.

        Args:
            queries: (B, T_q, d_q).
            k, v: (B, h_kv, T_k, d_k), (B, h_kv, T_k, d_v).
            mask, causal, return_attention_weights, training: as in `call`.
            projected_queries: optional (B, h, T_q, d_k), the queries already projected and split.

        Returns:
            output (B, T_q, d_model), and weights (B, h, T_q, T_k) when `return_attention_weights`.
        """
        self._check_built("attend_projected")
        # 1. project the queries, and split the heads: (B, T_q, h * d_k) -> (B, h, T_q, d_k)
        q = projected_queries
        if q is None:
            q = self._into_heads(self.W_q, queries)
        # 2. attend in every head at once
        options = dict(causal=causal, dropout=self.dropout, training=bool(training), seed=self.seed_generator)
        path = attention_path(self.num_kv_heads != self.h, return_attention_weights)
        if path == GROUPED:
            attended = grouped_query_attention(q, k, v, mask, return_attention_weights=return_attention_weights, **options)
            heads, weights = attended if return_attention_weights else (attended, None)
        elif path == EXPLICIT:
            heads, weights = scaled_dot_product_attention(q, k, v, mask, **options)  # (B, h, T_q, d_v)
        else:
            heads = fused_attention(q, k, v, mask, **options)  # (B, h, T_q, d_v)
        # 3. concatenate the heads, and 4. project to d_model
        output = self._from_heads(heads)  # (B, T_q, d_model)
        return (output, weights) if return_attention_weights else output

    def _check_inputs(self, queries, keys, values):
        shapes = {"queries": queries.shape, "keys": keys.shape, "values": values.shape}
        for name, shape in shapes.items():
            if len(shape) != 3:
                raise ValueError(
                    f"`{name}` must have rank 3, (batch, length, features). "
                    f"Received: {name}.shape={shape_str(shape)}"
                )
        batch = {s[0] for s in shapes.values() if s[0] is not None}
        if len(batch) > 1:
            raise ValueError(
                "`queries`, `keys` and `values` must have the same batch size. Received shapes: "
                + ", ".join(f"{n}={shape_str(s)}" for n, s in shapes.items())
            )
        if None not in (keys.shape[1], values.shape[1]) and keys.shape[1] != values.shape[1]:
            raise ValueError(
                "`keys` and `values` must have the same length T_k. Received shapes: "
                f"keys={shape_str(keys.shape)}, values={shape_str(values.shape)}"
            )
        check_positive_widths(shapes)
        for name, projection in (("queries", self.W_q), ("keys", self.W_k), ("values", self.W_v)):
            check_built_width(name, shapes[name], projection)

    def compute_mask(self, inputs, previous_mask=None):
        return keras_mask_of(inputs)  # the output is per query: it keeps the queries' padding

    def compute_output_shape(self, queries_shape, keys_shape=None, values_shape=None):
        return tuple(queries_shape[:-1]) + (self.d_model,)

    def compute_output_spec(
        self, queries, keys=None, values=None, mask=None, *, return_attention_weights=False, **kwargs
    ):
        # Symbolic calls (functional models) must see the weights too when they are asked for.
        output = keras.KerasTensor(self.compute_output_shape(queries.shape), dtype=self.compute_dtype)
        if not return_attention_weights:
            return output
        keys = queries if keys is None else keys
        weights_shape = (queries.shape[0], self.h, queries.shape[1], keys.shape[1])  # (B, h, T_q, T_k)
        return output, keras.KerasTensor(weights_shape, dtype=self.compute_dtype)

    def get_config(self):
        return {
            **super().get_config(),
            "h": self.h,
            "d_k": self.d_k,
            "d_v": self.d_v,
            "d_model": self.d_model,
            "dropout": self.dropout,
            "use_bias": self.use_bias,
            "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
            "bias_initializer": keras.initializers.serialize(self.bias_initializer),
            "seed": self.seed,
            "num_kv_heads": self.num_kv_heads,
            "join_keras_mask": self.join_keras_mask,
        }


# How MultiHeadAttention computes, chosen in `projection_path` and `attention_path` alone
# (docs/decisions.md item 48). "Plain" projections are neither quantized (Keras routes those to
# `quantized_call`) nor LoRA (their own kernel update).
#
# step     path          when                                          why
# project  SIDE_BY_SIDE  several plain projections of one input, torch one larger GEMM, one pass over x (item 13);
#                        dynamic int8 ones too: x quantized once (item 141)
# project  PER_HEAD      plain, jax                                    XLA picks layouts with fewer transposes (13)
# project  DENSE         otherwise: tensorflow, quantized, LoRA        Dense's own call; tensorflow's einsum transposes
# attend   GROUPED       num_kv_heads < h                              h_kv heads shared by query groups (item 33)
# attend   EXPLICIT      the weights are asked for                     the fused kernels return no weights
# attend   FUSED         otherwise                                     `ops.fused_attention` picks torch's SDPA, jax's
#                                                                      accelerator kernel, tiles or explicit (12, 21)
SIDE_BY_SIDE, PER_HEAD, DENSE = "side_by_side", "per_head", "dense"
GROUPED, EXPLICIT, FUSED = "grouped", "explicit", "fused"


def projection_path(projections, shared_input=False):
    """How to compute `projections` (Dense layers): SIDE_BY_SIDE (several projections of one input as
    one matmul, only when `shared_input`), PER_HEAD (einsums into and out of the heads) or DENSE."""
    plain = _plain(*projections)
    joinable = plain or _dynamic_int8(*projections)
    if shared_input and len(projections) > 1 and joinable and kernels.fuses_projections():
        return SIDE_BY_SIDE
    if plain and kernels.projects_into_heads():
        return PER_HEAD
    return DENSE


def attention_path(grouped, with_weights):
    """How to attend: GROUPED (fewer key/value heads), EXPLICIT (weights asked for) or FUSED."""
    if grouped:
        return GROUPED
    return EXPLICIT if with_weights else FUSED


def project_side_by_side(x, projections, dtype):
    """x (B, T, d_in) through Dense layers of one input as one matmul with their kernels side by side
    ([W_q | W_k | W_v], [W_gate | W_up]), the joined kernel kept between calls (`kernels.concat_last`):
    one pass over x and one larger GEMM instead of several. For paths chosen SIDE_BY_SIDE.

    Returns:
        One (B, T, units) tensor per projection, in order.
    """
    use_bias = [d.bias is not None for d in projections]
    if any(use_bias) and not all(use_bias):
        raise ValueError(f"`projections` must all have biases or none. Received: use_bias={use_bias}")
    if _dynamic_int8(*projections):
        # [W_q; W_k; W_v]'s int8 rows and scales, joined and kept: x is quantized once (docs/decisions.md item 141)
        values = kernels.concat_rows([d.block_values for d in projections])  # (sum units, d_in)
        scale = kernels.concat_rows([d.block_scale for d in projections])  # (sum units, 1)
        bias = kernels.concat_rows([d.bias for d in projections]) if all(use_bias) else None  # (sum units,)
        y = dynamic_int8.linear(ops.cast(x, "float32"), values, scale, bias)  # (B, T, sum units)
        return kernels.split_last(ops.cast(y, dtype), [d.units for d in projections])
    kernel = kernels.concat_last([d.kernel for d in projections], dtype)  # (d_in, sum units)
    bias = kernels.concat_last([d.bias for d in projections], dtype) if all(use_bias) else None  # (sum units,)
    y = linear(ops.cast(x, dtype), kernel, bias)  # (B, T, sum units)
    return kernels.split_last(y, [d.units for d in projections])


def _dynamic_int8(*projections):
    """Whether these hold dynamic int8 blocks of one input width and no LoRA (`keep_blocks(...,
    activations="int8")`): their rows can be one product side by side."""
    return all(
        holds_blocks(d) and d.block_format.get("activations") == "int8" and not d.lora_enabled
        and d.block_format["shape"][1] == projections[0].block_format["shape"][1]
        for d in projections
    )


def _plain(*projections):
    """Whether these Dense layers can be computed side by side in one matmul: quantized layers need
    their own `quantized_call`, and LoRA ones their own kernel update."""
    return all(d.quantization_mode is None and not d.lora_enabled for d in projections)
