"""`inference_function`: a Keras model's forward pass for inference only, run the fastest way each
backend offers:

- torch: eagerly under `torch.no_grad()`, so no autograd graph is recorded;
- jax: `jax.jit` of `stateless_call`, one compilation per input shape;
- tensorflow: a `tf.function` that relaxes its input shapes rather than retracing for each one.

The variables are read on every call, so weights assigned after the function was made are used.
"""

import keras


def inference_function(model, **call_kwargs):
    """Returns run(*inputs) = model(*inputs, training=False, **call_kwargs), without gradients.

    Args:
        model: a built Keras layer or model.
        **call_kwargs: fixed keyword arguments of every call (e.g. return_attention_weights=True).

    Returns:
        A function of the model's positional inputs, returning backend tensors.
    """
    backend = keras.backend.backend()
    if backend == "torch":
        import torch

        def run(*inputs):
            with torch.no_grad():
                return model(*inputs, training=False, **call_kwargs)

        return run
    if backend == "jax":
        return _jax_inference_function(model, call_kwargs)
    import tensorflow as tf

    return tf.function(lambda *inputs: model(*inputs, training=False, **call_kwargs), reduce_retracing=True)


def _jax_inference_function(model, call_kwargs):
    """`inference_function` on jax: `jax.jit` of `stateless_call`, the variables passed as arguments.

    Under a mixed policy (`mixed_bfloat16`), a float32 variable that the model only ever reads cast
    to the compute dtype (a kernel, a bias) is passed already cast, from a copy kept while the
    variable holds the same value: the program then does not convert it again on every call (the
    StatelessScope's exact widening and the layer's narrowing cancel). Which variables those are is
    read off the traced program, once per input signature: every use of the variable's argument is
    a conversion to one half-precision dtype. A variable used otherwise (a LayerNorm's gamma, an
    embedding table gathered first) is passed as it is. The numbers are the model's own, bit for bit
    (docs/decisions.md item 67).
    """
    import jax

    def call(trainable, non_trainable, *inputs):
        outputs, _ = model.stateless_call(trainable, non_trainable, *inputs, training=False, **call_kwargs)
        return outputs

    stateless = jax.jit(call)
    narrowed = {}  # signature -> per variable, the dtype to pass it in, or None
    kept = {}  # variable position -> (the value it was cast from, the dtype, the cast)

    def run(*inputs):
        variables = [*model.trainable_variables, *model.non_trainable_variables]
        values = [v.value for v in variables]
        # Variables replaced (quantize, LoRA) or inputs of another structure or shape: another program.
        leaves, structure = jax.tree_util.tree_flatten(inputs)
        signature = (len(model.trainable_variables), *((id(v), v.dtype, tuple(v.shape)) for v in variables),
                     structure, *((jax.numpy.shape(x), jax.numpy.result_type(x)) for x in leaves))
        if signature not in narrowed:
            narrowed[signature] = _narrowed_dtypes(call, len(model.trainable_variables), values, inputs)
        # Only the casts this call passes are kept: replaced or no longer narrowed variables are let go.
        now = {}
        for i, dtype in enumerate(narrowed[signature]):
            if dtype is not None:
                source, source_dtype, cast = kept.get(i, (None, None, None))
                if source is not values[i] or source_dtype != dtype:
                    cast = values[i].astype(dtype)
                now[i] = (values[i], dtype, cast)
                values[i] = cast
        kept.clear()
        kept.update(now)
        n = len(model.trainable_variables)
        return stateless(values[:n], values[n:], *inputs)

    return run


def _narrowed_dtypes(call, n_trainable, values, inputs):
    """For each of `values` (the variables' float32 values, trainable first), the half-precision dtype
    every use of it in `call`'s traced program converts it to, or None: used otherwise, not used, or
    not float32."""
    import jax
    import jax.numpy as jnp

    jaxpr = jax.make_jaxpr(call)(values[:n_trainable], values[n_trainable:], *inputs).jaxpr
    arguments = jaxpr.invars[: len(values)]  # the variables' values, flattened in order, then the inputs
    uses = {a: set() for a in arguments}
    for eqn in jaxpr.eqns:
        for x in eqn.invars:
            if type(x).__name__ != "Literal" and x in uses:
                converted = eqn.primitive.name == "convert_element_type"
                uses[x].add(eqn.params["new_dtype"] if converted else None)
    for x in jaxpr.outvars:
        if type(x).__name__ != "Literal" and x in uses:
            uses[x].add(None)
    dtypes = []
    for a in arguments:
        (dtype,) = uses[a] if len(uses[a]) == 1 else (None,)
        half = dtype in (jnp.bfloat16, jnp.float16) and a.aval.dtype == jnp.float32
        dtypes.append(dtype if half else None)
    return dtypes
