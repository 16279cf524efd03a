"""Training a `Transformer` on the embedded date task, and translating with it.

`DateTranslator` bundles a model and its character tokenizer; `train_dates` trains one with Keras's
`fit` (and its progress bar); `save`/`load` round-trip it through a directory:

    model.keras        the Keras model (weights and config)
    translator.json    the tokenizer alphabet, the source length and model.keras's SHA-256

Legend: N examples, S source length, T target length (including the start or end token).
"""

import json
import os
import time
import zipfile
from dataclasses import dataclass

import keras
import numpy as np

from attnkit._atomic_save import file_sha256, replace_files
from attnkit._keras_saving import save_model
from attnkit._seed import set_random_seed
from attnkit.distributed import data_parallel_plan, single_device_plan
from attnkit.distributed.engines import CommittedState
from attnkit.distributed.watchdog import FIRST_STEP_SECONDS, STEP_SECONDS, StepWatchdog
from attnkit.models.decoding import beam_search, greedy_decode
from attnkit.models.transformer import Transformer
from attnkit.dates import task as dates

MODEL_FILE, META_FILE = "model.keras", "translator.json"
TARGET_LENGTH = 12  # start + "YYYY-MM-DD" + end


SCHEDULES = ("cosine", "constant")


@dataclass
class TrainConfig:
    """Sizes and schedule of the demo model (the defaults are the demo's).

    `learning_rate` is Adam's peak rate: with `schedule="cosine"` it rises linearly from 0 over the
    first `warmup` fraction of the steps, then falls to 0 along a half cosine; with "constant" it is
    the rate of every step (and `warmup` must be 0). docs/decisions.md item 53.
    """

    epochs: int = 4
    batch_size: int = 128
    n_train: int = 14000
    n_validation: int = 1000
    d_model: int = 64
    h: int = 4
    d_ff: int = 256
    n: int = 2
    rate: float = 0.0
    learning_rate: float = 5e-3
    source_length: int = 32
    seed: int = 0
    schedule: str = "cosine"
    warmup: float = 0.1


def make_optimizer(config, steps_per_epoch):
    """Adam with `config`'s learning-rate schedule over `config.epochs * steps_per_epoch` steps.

    beta_2 is the paper's 0.98 (section 5.3), the value the demo's schedule was tuned with
    (docs/decisions.md item 53).

    Raises:
        ValueError: an unknown `schedule`, a `warmup` outside [0, 1) (or not 0 with "constant"), or a
            non-positive `learning_rate`, naming the field.
    """
    if config.schedule not in SCHEDULES:
        raise ValueError(f"`schedule` must be one of {', '.join(SCHEDULES)}. Received: schedule={config.schedule!r}")
    if isinstance(config.warmup, bool) or not isinstance(config.warmup, (int, float)) or not 0 <= config.warmup < 1:
        raise ValueError(f"`warmup` must be a fraction of the steps in [0, 1). Received: warmup={config.warmup!r}")
    if config.schedule == "constant" and config.warmup:
        raise ValueError(f"`warmup` must be 0 with schedule='constant'. Received: warmup={config.warmup!r}")
    if isinstance(config.learning_rate, bool) or not isinstance(config.learning_rate, (int, float)) or not config.learning_rate > 0:
        raise ValueError(f"`learning_rate` must be a positive number. Received: learning_rate={config.learning_rate!r}")
    rate = float(config.learning_rate)
    if config.schedule == "cosine":
        steps = max(1, config.epochs * steps_per_epoch)
        warmup = int(config.warmup * steps)
        rate = keras.optimizers.schedules.CosineDecay(
            0.0, steps - warmup, warmup_target=rate, warmup_steps=warmup
        ) if warmup else keras.optimizers.schedules.CosineDecay(rate, steps)
    return keras.optimizers.Adam(rate, beta_2=0.98)


class DateTranslator:
    """A trained `Transformer` with its tokenizer: text in, ISO date out.

    Args:
        model: an attnkit `Transformer` whose vocabularies are the tokenizer's, whose encoder takes
            `source_length` tokens, whose padding id is the tokenizer's, and whose decoder can emit a
            date and its end token.
        tokenizer: a `dates.CharTokenizer`.
        source_length: S, the encoder's input length.

    Raises:
        TypeError: a `model` that is not a `Transformer`.
        ValueError: a model that does not match the tokenizer or `source_length`, naming the field.
    """

    def __init__(self, model, tokenizer, source_length):
        _check_model(model, tokenizer, source_length)
        self.model, self.tokenizer, self.source_length = model, tokenizer, source_length

    def encode_sources(self, texts):
        """Texts -> (N, S) source ids; an empty or too long text raises ValueError naming it.

        Characters outside the tokenizer's alphabet become the unknown token (id 3), which the model saw
        in no training example: the output for such a text is a guess, not an error
        (`unknown_characters` finds them).
        """
        texts = _check_texts(texts)
        for i, text in enumerate(texts):
            if not text.strip():
                raise ValueError(
                    f"Input {i} ({text!r}) is empty or only whitespace: there is no date to translate"
                )
            if len(text) > self.source_length:
                raise ValueError(
                    f"Input {text!r} has {len(text)} characters; the model takes at most {self.source_length}"
                )
        if not texts:
            return np.zeros((0, self.source_length), np.int32)
        return self.tokenizer.encode_batch(texts, self.source_length)

    def unknown_characters(self, text):
        """The characters of `text` outside the tokenizer's alphabet, each once, in order of appearance."""
        return "".join(dict.fromkeys(c for c in text if c not in self.tokenizer.ids))

    def translate(self, texts, *, beam_size=1, return_scores=False, return_attention_weights=False, batch_size=256):
        """Translates a list of texts: one output per text, in order (an empty list gives []).

        Args:
            texts: a list of N non-empty strings of at most `source_length` characters.
            beam_size: 1 for greedy decoding, K > 1 for beam search.
            return_scores: also return each output's log-probability under the model (N,) float64:
                the sum of the log-softmax of every generated token, the end token included.
            return_attention_weights: also return the `Decoded` of every batch (greedy only).
            batch_size: texts per decoding batch.

        Returns:
            The list of N output strings; with `return_scores`, (outputs, scores); with
            `return_attention_weights`, the list of `Decoded`s last.

        Raises:
            ValueError: an empty or too long text, naming it.
        """
        outputs, scores, results = [], [], []
        tok = self.tokenizer
        texts = _check_texts(texts)
        source = self.encode_sources(texts)  # every text checked before any decoding
        for i in range(0, len(texts), batch_size):
            if beam_size > 1:
                result = beam_search(
                    self.model, source[i:i + batch_size], beam_size=beam_size, start_id=tok.START, end_id=tok.END
                )
            else:
                result = greedy_decode(
                    self.model, source[i:i + batch_size], start_id=tok.START, end_id=tok.END,
                    return_attention_weights=return_attention_weights,
                )
            outputs += [tok.decode(ids) for ids in result.ids]
            scores.append(result.scores)
            results.append(result)
        returned = [outputs]
        if return_scores:
            returned.append(np.concatenate(scores) if scores else np.zeros(0))
        if return_attention_weights:
            returned.append(results)
        return tuple(returned) if len(returned) > 1 else outputs

    def exact_match(self, pairs, **kwargs):
        """The fraction of (source, target) pairs translated exactly."""
        predicted = self.translate([s for s, _ in pairs], **kwargs)
        return float(np.mean([p == t for p, (_, t) in zip(predicted, pairs)]))

    def save(self, directory, *, overwrite=False):
        """Writes model.keras and translator.json into `directory` (refuses to overwrite unless asked).

        Both files are written aside and renamed into place together: an interrupt leaves the previous
        pair or the new one (`attnkit._atomic_save`, docs/decisions.md item 23).

        Raises:
            FileExistsError: a file already there without `overwrite`.
            ValueError: an existing model.keras or translator.json that is not a regular file.
            OSError: a file that cannot be written (the previous files are kept).
        """
        for name in (MODEL_FILE, META_FILE):
            path = os.path.join(directory, name)
            if os.path.lexists(path) and not overwrite:
                raise FileExistsError(f"{path} exists; pass overwrite=True (--force) to replace it")
        replace_files(directory, self.writers())

    def writers(self):
        """{file name: function writing it at a path}, in the order `save` writes them (model first:
        translator.json records its SHA-256)."""

        def write_meta(path):
            meta = {
                "alphabet": self.tokenizer.alphabet,
                "source_length": self.source_length,
                "model_sha256": file_sha256(os.path.join(os.path.dirname(path), MODEL_FILE)),
            }
            with open(path, "w", encoding="utf-8") as f:
                json.dump(meta, f, indent=2)

        return {MODEL_FILE: lambda path: save_model(self.model, path), META_FILE: write_meta}  # no tensorflow import

    @classmethod
    def load(cls, directory):
        """Reads a directory written by `save`, and checks translator.json against model.keras.

        Raises:
            FileNotFoundError: a missing model.keras or translator.json, naming it.
            ValueError: a translator.json that is not valid JSON, lacks a field, has an unknown one, or
                has a field that does not match the model (the alphabet's size against the
                vocabularies, source_length against the encoder's length, model_sha256 against
                model.keras); a model.keras that Keras cannot read or that is not a date translator.
                The message names the file and the field.
        """
        for name in (MODEL_FILE, META_FILE):
            path = os.path.join(directory, name)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"No {name} in model directory {directory!r}: was it written by `attnkit train`?")
        meta_path, model_path = os.path.join(directory, META_FILE), os.path.join(directory, MODEL_FILE)
        alphabet, source_length, digest = _read_meta(meta_path)
        if not zipfile.is_zipfile(model_path):
            raise ValueError(f"{model_path}: not a Keras model archive (truncated or corrupt?)")
        if digest is not None and digest != file_sha256(model_path):
            raise ValueError(
                f"{meta_path}: `model_sha256` does not match {model_path}: the two files are not from the same "
                "save (an interrupted copy, or one of them replaced)"
            )
        model = _load_model(model_path)
        if not isinstance(model, Transformer):
            raise ValueError(f"{model_path}: holds a {type(model).__name__}, not an attnkit Transformer")
        tokenizer = dates.CharTokenizer(alphabet)
        try:
            _check_model(model, tokenizer, source_length)
        except ValueError as e:
            raise ValueError(f"{meta_path} does not match {model_path}: {e}") from None
        return cls(model, tokenizer, source_length)


META_FIELDS = ("alphabet", "source_length", "model_sha256")  # model_sha256: absent in older saves


def _check_texts(texts):
    if isinstance(texts, (str, bytes)) or not isinstance(texts, (list, tuple)):
        raise TypeError(f"`texts` must be a list of strings. Received: texts of type {type(texts).__name__}")
    wrong = sorted({type(t).__name__ for t in texts if not isinstance(t, str)})
    if wrong:
        raise TypeError(f"`texts` must be a list of strings. Received: list with items of type {wrong}")
    return list(texts)


def _check_model(model, tokenizer, source_length):
    """Refuses a model that does not fit the tokenizer and source length (docs/decisions.md item 24)."""
    if not isinstance(model, Transformer):
        raise TypeError(f"`model` must be an attnkit Transformer. Received: model of type {type(model).__name__}")
    V = tokenizer.vocab_size
    for side in ("encoder", "decoder"):
        vocab_size = getattr(model, side).vocab_size
        if vocab_size != V:
            raise ValueError(
                f"`alphabet` has {len(tokenizer.alphabet)} characters, so {V} token ids with the "
                f"{len(tokenizer.SPECIALS)} special ones, but the model's {side} has a vocabulary of {vocab_size}"
            )
    if source_length != model.encoder.sequence_length:
        raise ValueError(
            f"`source_length` is {source_length} but the model's encoder takes "
            f"{model.encoder.sequence_length} tokens (enc_seq_length)"
        )
    if model.pad_id != tokenizer.PAD:
        raise ValueError(f"the model's pad_id is {model.pad_id} but the tokenizer pads with {tokenizer.PAD}")
    if model.decoder.sequence_length < TARGET_LENGTH - 1:
        raise ValueError(
            f"the model's decoder emits at most {model.decoder.sequence_length} tokens (dec_seq_length); a date and "
            f"its end token take {TARGET_LENGTH - 1}"
        )


def _read_meta(path):
    """translator.json's (alphabet, source_length, model_sha256 or None), each field checked."""
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: expected a JSON object with alphabet and source_length. Received: {type(meta).__name__}")
    missing = [key for key in META_FIELDS[:2] if key not in meta]
    if missing:
        raise ValueError(f"{path}: missing {' and '.join(missing)}; it should be the file `attnkit train` writes")
    unknown = [key for key in meta if key not in META_FIELDS]
    if unknown:
        raise ValueError(f"{path}: unknown field {', '.join(map(repr, unknown))}; the fields are {', '.join(META_FIELDS)}")
    alphabet, source_length, digest = meta["alphabet"], meta["source_length"], meta.get("model_sha256")
    if not isinstance(alphabet, str) or not alphabet:
        raise ValueError(f"{path}: `alphabet` must be a non-empty string. Received: alphabet={alphabet!r}")
    repeated = "".join(c for c in dict.fromkeys(alphabet) if alphabet.count(c) > 1)
    if repeated:
        raise ValueError(f"{path}: `alphabet` must not repeat a character. Received: {repeated!r} more than once")
    if isinstance(source_length, bool) or not isinstance(source_length, int) or source_length <= 0:
        raise ValueError(f"{path}: `source_length` must be a positive integer. Received: source_length={source_length!r}")
    if digest is not None and not (isinstance(digest, str) and len(digest) == 64 and set(digest) <= set("0123456789abcdef")):
        raise ValueError(f"{path}: `model_sha256` must be 64 lowercase hex digits. Received: model_sha256={digest!r}")
    return alphabet, source_length, digest


def _load_model(path):
    """`keras.saving.load_model`, with a damaged file named as such."""
    try:
        return keras.saving.load_model(path)
    except (ValueError, TypeError, OSError, KeyError, zipfile.BadZipFile, EOFError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{path}: Keras cannot load the model (truncated or corrupt?): {first}") from None


def make_arrays(pairs, tokenizer, source_length):
    """(source ids (N, S), decoder input (N, T), decoder target (N, T), target weights (N, T))."""
    source = tokenizer.encode_batch([s for s, _ in pairs], source_length)
    target = tokenizer.encode_batch([t for _, t in pairs], TARGET_LENGTH, start=True, end=True)  # <s> y </s>
    decoder_input, decoder_target = target[:, :-1], target[:, 1:]  # teacher forcing: shift by one
    return source, decoder_input, decoder_target, (decoder_target != tokenizer.PAD).astype("float32")


def build_model(config, tokenizer):
    return Transformer(
        tokenizer.vocab_size, tokenizer.vocab_size, config.source_length, TARGET_LENGTH - 1,
        config.h, config.d_model // config.h, config.d_model // config.h, config.d_model, config.d_ff,
        config.n, config.rate, pad_id=tokenizer.PAD,
    )


def train_dates(config=TrainConfig(), *, verbose=1, time_budget=None, data_parallel=False, log=None, callbacks=()):
    """Trains a `Transformer` on the date task with `fit`.

    Args:
        config: a `TrainConfig`.
        verbose: Keras's verbosity (1 = progress bar).
        time_budget: optional seconds after which training stops at the end of an epoch.
        data_parallel: train over all local devices (and hosts) with the backend's distributed engine,
            keeping `config.batch_size` as the global batch; see `attnkit.distributed` (jax, tensorflow).
            A step that does not finish within a minute (five for the first) ends the process with one
            line (`attnkit.distributed.watchdog`).
        log: called with one line naming the engine and the devices, when given.
        callbacks: extra Keras callbacks for `fit` (the benchmark's exact-match probe, say).

    Returns:
        (DateTranslator, validation pairs, keras History).

    Raises:
        ValueError: `data_parallel` on the torch backend, or a batch size that does not split evenly.
    """
    plan = data_parallel_plan() if data_parallel else single_device_plan()
    batch_size = plan.local_batch_size(config.batch_size)  # this process's share of the global batch
    if log:
        log(f"{plan.describe()}; global batch {config.batch_size}, {config.batch_size // plan.num_devices} per device")
    set_random_seed(config.seed)
    tokenizer = dates.CharTokenizer()
    train, validation = dates.train_validation_split(config.n_train, config.n_validation, seed=config.seed)
    source, decoder_input, decoder_target, weights = plan.local_examples(
        *make_arrays(train, tokenizer, config.source_length), name="n_train"
    )
    val = plan.local_examples(*make_arrays(validation, tokenizer, config.source_length), name="n_validation")
    steps_per_epoch = -(-len(source) // batch_size)  # fit's steps, the last batch possibly smaller
    with plan.scope():
        model = build_model(config, tokenizer)
        model.compile(
            optimizer=make_optimizer(config, steps_per_epoch),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            weighted_metrics=["accuracy"],
        )
        callbacks = list(callbacks) + ([_TimeBudget(time_budget)] if time_budget else [])
        callbacks.append(CommittedState())  # under a jax distribution: one compiled train step, not three
        if data_parallel:
            callbacks.append(StepWatchdog("data-parallel training", STEP_SECONDS, FIRST_STEP_SECONDS))
        history = model.fit(
            (source, decoder_input), decoder_target, sample_weight=weights,
            batch_size=batch_size, epochs=config.epochs,
            validation_data=((val[0], val[1]), val[2], val[3]), verbose=verbose, callbacks=callbacks, shuffle=True,
        )
    return DateTranslator(model, tokenizer, config.source_length), validation, history


class _TimeBudget(keras.callbacks.Callback):
    def __init__(self, seconds):
        super().__init__()
        self.seconds, self.start = seconds, time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        if time.perf_counter() - self.start > self.seconds:
            self.model.stop_training = True
