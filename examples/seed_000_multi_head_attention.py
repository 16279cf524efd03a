"""Seed 000's test listing, redone with attnkit: multi-head attention with the paper's sizes.

As in the seed: h = 8 heads, d_k = d_v = 64, d_model = 512, a batch of 64 random sequences of length 5.
In attnkit d_k and d_v are per head (the paper's meaning), so the projections are 8 x 64 = 512 wide;
the output shape is the seed's.

    python examples/seed_000_multi_head_attention.py     # prints: output shape: (64, 5, 512)
"""

import numpy as np

import attnkit  # chooses the Keras backend (torch unless KERAS_BACKEND says otherwise)
import keras

h = 8  # number of heads
d_k = 64  # per-head width of the projected queries and keys
d_v = 64  # per-head width of the projected values
d_model = 512  # width of the output
batch_size = 64
input_seq_length = 5

rng = np.random.default_rng(0)
queries = rng.random((batch_size, input_seq_length, d_k)).astype("float32")
keys = rng.random((batch_size, input_seq_length, d_k)).astype("float32")
values = rng.random((batch_size, input_seq_length, d_v)).astype("float32")

multihead_attention = attnkit.MultiHeadAttention(h, d_k, d_v, d_model)
output = multihead_attention(queries, keys, values)
print(keras.ops.convert_to_numpy(output)[0, :2, :4])  # a corner of the first sequence
print(f"output shape: {tuple(output.shape)}")
