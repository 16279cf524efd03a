"""Training a `Transformer` on the embedded date task, and translating with it.

`DateTranslator` bundles a model and its character tokenizer; `train_dates` trains one with Keras's
`fit` (and its progress bar); `save`/`load` round-trip it through a directory:

    model.keras        the Keras model (weights and config)
    translator.json    the tokenizer alphabet and the sequence lengths

Legend: N examples, S source length, T target length (including the start or end token).
"""

import json
import os
import time
from dataclasses import dataclass

import keras
import numpy as np

from attnkit.distributed import data_parallel_plan, single_device_plan
from attnkit.distributed.watchdog import FIRST_STEP_SECONDS, STEP_SECONDS, StepWatchdog
from attnkit.models.decoding import beam_search, greedy_decode
from attnkit.models.transformer import Transformer
from attnkit.tasks import dates

MODEL_FILE, META_FILE = "model.keras", "translator.json"
TARGET_LENGTH = 12  # start + "YYYY-MM-DD" + end


@dataclass
class TrainConfig:
    """Sizes and schedule of the demo model (the defaults are the demo's)."""

    epochs: int = 7
    batch_size: int = 128
    n_train: int = 16000
    n_validation: int = 1000
    d_model: int = 64
    h: int = 4
    d_ff: int = 256
    n: int = 2
    rate: float = 0.1
    learning_rate: float = 3e-3
    source_length: int = 32
    seed: int = 0


class DateTranslator:
    """A trained `Transformer` with its tokenizer: text in, ISO date out."""

    def __init__(self, model, tokenizer, source_length):
        self.model, self.tokenizer, self.source_length = model, tokenizer, source_length

    def encode_sources(self, texts):
        """Texts -> (N, S) source ids; a text longer than `source_length` raises ValueError.

        Characters outside the tokenizer's alphabet become the unknown token (id 3), which the model saw
        in no training example: the output for such a text is a guess, not an error.
        """
        for text in texts:
            if len(text) > self.source_length:
                raise ValueError(
                    f"Input {text!r} has {len(text)} characters; the model takes at most {self.source_length}"
                )
        return self.tokenizer.encode_batch(texts, self.source_length)

    def translate(self, texts, *, beam_size=1, return_attention_weights=False, batch_size=256):
        """Translates a list of texts. Returns the list of outputs (and, when asked, the `Decoded`s)."""
        outputs, results = [], []
        tok = self.tokenizer
        for i in range(0, len(texts), batch_size):
            source = self.encode_sources(texts[i:i + batch_size])
            if beam_size > 1:
                result = beam_search(self.model, source, beam_size=beam_size, start_id=tok.START, end_id=tok.END)
            else:
                result = greedy_decode(
                    self.model, source, start_id=tok.START, end_id=tok.END,
                    return_attention_weights=return_attention_weights,
                )
            outputs += [tok.decode(ids) for ids in result.ids]
            results.append(result)
        return (outputs, results) if return_attention_weights else outputs

    def exact_match(self, pairs, **kwargs):
        """The fraction of (source, target) pairs translated exactly."""
        predicted = self.translate([s for s, _ in pairs], **kwargs)
        return float(np.mean([p == t for p, (_, t) in zip(predicted, pairs)]))

    def save(self, directory, *, overwrite=False):
        """Writes model.keras and translator.json into `directory` (refuses to overwrite unless asked)."""
        os.makedirs(directory, exist_ok=True)
        for name in (MODEL_FILE, META_FILE):
            path = os.path.join(directory, name)
            if os.path.exists(path) and not overwrite:
                raise FileExistsError(f"{path} exists; pass overwrite=True (--force) to replace it")
        self.model.save(os.path.join(directory, MODEL_FILE))
        meta = {"alphabet": self.tokenizer.alphabet, "source_length": self.source_length}
        with open(os.path.join(directory, META_FILE), "w") as f:
            json.dump(meta, f, indent=2)

    @classmethod
    def load(cls, directory):
        """Reads a directory written by `save`.

        Raises:
            FileNotFoundError: a missing model.keras or translator.json, naming it.
            ValueError: a translator.json that is not valid JSON or lacks its keys, or a model.keras
                that Keras cannot read (truncated or corrupt), naming the file and the problem.
        """
        for name in (MODEL_FILE, META_FILE):
            path = os.path.join(directory, name)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"No {name} in model directory {directory!r}: was it written by `attnkit train`?")
        alphabet, source_length = _read_meta(os.path.join(directory, META_FILE))
        model = _load_model(os.path.join(directory, MODEL_FILE))
        return cls(model, dates.CharTokenizer(alphabet), source_length)


def _read_meta(path):
    """translator.json's (alphabet, source_length), checked."""
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: expected a JSON object with alphabet and source_length. Received: {type(meta).__name__}")
    missing = [key for key in ("alphabet", "source_length") if key not in meta]
    if missing:
        raise ValueError(f"{path}: missing {' and '.join(missing)}; it should be the file `attnkit train` writes")
    alphabet, source_length = meta["alphabet"], meta["source_length"]
    if not isinstance(alphabet, str) or not alphabet:
        raise ValueError(f"{path}: `alphabet` must be a non-empty string. Received: alphabet={alphabet!r}")
    if isinstance(source_length, bool) or not isinstance(source_length, int) or source_length <= 0:
        raise ValueError(f"{path}: `source_length` must be a positive integer. Received: source_length={source_length!r}")
    return alphabet, source_length


def _load_model(path):
    """`keras.saving.load_model`, with a damaged file named as such (Keras says "File not found" for
    a file that is not a zip archive)."""
    import zipfile

    if not zipfile.is_zipfile(path):
        raise ValueError(f"{path}: not a Keras model archive (truncated or corrupt?)")
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


def train_dates(config=TrainConfig(), *, verbose=1, time_budget=None, data_parallel=False, log=None):
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

    Returns:
        (DateTranslator, validation pairs, keras History).

    Raises:
        ValueError: `data_parallel` on the torch backend, or a batch size that does not split evenly.
    """
    plan = data_parallel_plan() if data_parallel else single_device_plan()
    batch_size = plan.local_batch_size(config.batch_size)  # this process's share of the global batch
    if log:
        log(f"{plan.describe()}; global batch {config.batch_size}, {config.batch_size // plan.num_devices} per device")
    keras.utils.set_random_seed(config.seed)
    tokenizer = dates.CharTokenizer()
    train, validation = dates.train_validation_split(config.n_train, config.n_validation, seed=config.seed)
    source, decoder_input, decoder_target, weights = plan.local_examples(
        *make_arrays(train, tokenizer, config.source_length), name="n_train"
    )
    val = plan.local_examples(*make_arrays(validation, tokenizer, config.source_length), name="n_validation")
    with plan.scope():
        model = build_model(config, tokenizer)
        model.compile(
            optimizer=keras.optimizers.Adam(config.learning_rate),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            weighted_metrics=["accuracy"],
        )
        callbacks = [_TimeBudget(time_budget)] if time_budget else []
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
