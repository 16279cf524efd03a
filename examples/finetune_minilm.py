"""Fine-tune the embedded all-MiniLM-L6-v2 with Keras's `fit` on a small labelled task, export it as a
Hugging Face directory, and load it back in sentence-transformers.

The task: does a sentence talk about animals (1) or about money (0)? A mean-pooled MiniLM embedding
feeds a softmax classifier; `fit` trains both (the encoder's layers included). The fine-tuned encoder
is then written with `save_pretrained`, and sentence-transformers' embeddings of the exported
directory equal attnkit's.

    python examples/finetune_minilm.py [--output-dir runs/minilm-animals] [--epochs 3]
"""

import argparse
import os
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import ops  # noqa: E402

import attnkit  # noqa: E402

ANIMALS = ["The cat sleeps on the sofa.", "A dog chased the ball across the park.", "Horses graze in the field.",
           "The parrot repeated every word.", "Two rabbits hid under the hedge.", "The cow gave a lot of milk.",
           "An owl hooted all night.", "The kitten played with a string.", "Sheep crowded by the gate.",
           "A fox crept past the henhouse.", "The puppy chewed my shoe.", "Ducks swam across the pond."]
MONEY = ["The bank raised its interest rates.", "Stocks fell sharply on Monday.", "She paid the invoice by card.",
         "The budget has a large deficit.", "Inflation eroded their savings.", "He borrowed money to buy a house.",
         "The company reported record profits.", "Taxes are due at the end of April.",
         "The loan carries a fixed rate.", "Investors sold their bonds.", "Prices at the shop went up again.",
         "The salary is paid monthly."]


class Classifier(keras.Model):
    """softmax(W mean_pool(encoder(ids)) + b): two classes over the encoder's mean-pooled tokens."""

    def __init__(self, encoder, **kwargs):
        super().__init__(**kwargs)
        self.encoder = encoder
        self.head = keras.layers.Dense(2, activation="softmax")

    def call(self, inputs, training=None):
        token_ids, padding_mask = inputs
        hidden = self.encoder(token_ids, padding_mask, training=training)  # (B, T, d_model)
        weights = ops.cast(padding_mask, hidden.dtype)[..., None]  # (B, T, 1)
        pooled = ops.sum(hidden * weights, axis=1) / ops.maximum(ops.sum(weights, axis=1), 1e-9)  # (B, d_model)
        return self.head(pooled)  # (B, 2)


def run(output_dir, epochs=3, learning_rate=5e-5, seed=0, train_layers=None):
    """Fine-tunes, exports to `output_dir` and reloads in sentence-transformers.

    Args:
        train_layers: train only the last this many encoder layers (and the head); default None:
            the whole encoder.

    Returns:
        dict: accuracy before and after, the largest weight change, and the largest difference
        between attnkit's and sentence-transformers' embeddings of the exported model.
    """
    keras.utils.set_random_seed(seed)
    encoder = attnkit.load_pretrained()
    texts, labels = ANIMALS + MONEY, np.array([1] * len(ANIMALS) + [0] * len(MONEY))
    token_ids, padding_mask, _ = encoder.tokenize(texts)
    watched = encoder.model.encoder_layers[-1].feed_forward.fully_connected1.kernel
    before = keras.ops.convert_to_numpy(watched)
    encoder.model.trainable = True  # load_pretrained freezes it for inference
    if train_layers is not None:
        encoder.model.token_position_embedding.trainable = False
        encoder.model.embedding_norm.trainable = False
        if encoder.model.token_type_embedding is not None:
            encoder.model.token_type_embedding.trainable = False
        for layer in encoder.model.encoder_layers[: encoder.model.n - train_layers]:
            layer.trainable = False
    classifier = Classifier(encoder.model)
    classifier.compile(optimizer=keras.optimizers.Adam(learning_rate), loss="sparse_categorical_crossentropy",
                       metrics=["accuracy"])
    accuracy_before = classifier.evaluate((token_ids, padding_mask), labels, verbose=0)[1]
    classifier.fit((token_ids, padding_mask), labels, batch_size=8, epochs=epochs, shuffle=True, verbose=0)
    accuracy_after = classifier.evaluate((token_ids, padding_mask), labels, verbose=0)[1]
    encoder.model.trainable = False
    change = float(np.abs(keras.ops.convert_to_numpy(watched) - before).max())

    encoder.save_pretrained(output_dir, overwrite=True)
    from sentence_transformers import SentenceTransformer

    reloaded = SentenceTransformer(output_dir, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        difference = float(np.abs(reloaded.encode(texts) - encoder.encode(texts)).max())
    return dict(accuracy_before=accuracy_before, accuracy_after=accuracy_after, weight_change=change,
                export_difference=difference)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", default=os.path.join("runs", "minilm-animals"))
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    result = run(args.output_dir, epochs=args.epochs)
    print(f"accuracy {result['accuracy_before']:.2f} -> {result['accuracy_after']:.2f}; "
          f"exported to {args.output_dir}; sentence-transformers reloads it with embeddings within "
          f"{result['export_difference']:.1e} of attnkit's")


if __name__ == "__main__":
    main()
