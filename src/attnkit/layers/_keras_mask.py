"""Reading and writing the mask Keras attaches to tensors (e.g. from `Embedding(mask_zero=True)`)."""


def keras_mask_of(x):
    """The (B, T) boolean Keras mask carried by `x`, or None."""
    try:
        from keras.src.backend import get_keras_mask
    except ImportError:  # older Keras 3 kept it as a plain attribute
        return getattr(x, "_keras_mask", None)
    return get_keras_mask(x)


def with_keras_mask(x, mask):
    """`x`, carrying `mask` as its Keras mask (what a layer's `__call__` attaches to its output)."""
    try:
        from keras.src.backend import set_keras_mask
    except ImportError:
        x._keras_mask = mask
        return x
    set_keras_mask(x, mask)
    return x
