"""Seed 002's test listing, redone with attnkit: the Transformer encoder with the paper's sizes.

As in the seed: vocabulary 20, sequences of length 5, h = 8, d_k = d_v = 64, d_ff = 2048,
d_model = 512, n = 6 layers, dropout 0.1, a batch of 64, called as `encoder(ids, None, True)`.
One change: the seed feeds random floats in [0, 1) as token ids; these are integer ids in [0, 20).
(attnkit refuses fractional ids with a ValueError.) Id 0 is padding and is masked out automatically.

    python examples/seed_002_encoder.py     # prints: output shape: (64, 5, 512)
"""

import numpy as np

import attnkit  # chooses the Keras backend (torch unless KERAS_BACKEND says otherwise)
import keras

enc_vocab_size = 20  # vocabulary size of the encoder
input_seq_length = 5  # longest input sequence
h = 8  # number of heads
d_k = 64  # per-head width of the projected queries and keys
d_v = 64  # per-head width of the projected values
d_ff = 2048  # inner width of the feed-forward networks
d_model = 512  # width of every sub-layer's output
n = 6  # number of layers in the encoder stack

batch_size = 64
dropout_rate = 0.1

input_seq = np.random.default_rng(0).integers(0, enc_vocab_size, (batch_size, input_seq_length))

encoder = attnkit.Encoder(enc_vocab_size, input_seq_length, h, d_k, d_v, d_model, d_ff, n, dropout_rate)
output = encoder(input_seq, None, True)  # padding mask from the ids; training=True: dropout on
print(keras.ops.convert_to_numpy(output)[0, :2, :4])  # a corner of the first sequence
print(f"output shape: {tuple(output.shape)}")
