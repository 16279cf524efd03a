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
        import jax

        @jax.jit
        def stateless(trainable, non_trainable, *inputs):
            outputs, _ = model.stateless_call(trainable, non_trainable, *inputs, training=False, **call_kwargs)
            return outputs

        def run(*inputs):
            trainable = [v.value for v in model.trainable_variables]
            non_trainable = [v.value for v in model.non_trainable_variables]
            return stateless(trainable, non_trainable, *inputs)

        return run
    import tensorflow as tf

    return tf.function(lambda *inputs: model(*inputs, training=False, **call_kwargs), reduce_retracing=True)
