"""A checkpoint directory's generation_config.json as the defaults of `PretrainedCausalLM`'s generation
options, as transformers' `generate` takes them (docs/decisions.md item 88).

transformers reads the file's decoding strategy when `generate` is called without options: with
`"do_sample": true`, sampling at the file's temperature (default 1.0), top-k (default 50; 0 = none)
and top-p; otherwise greedy. `repetition_penalty` applies to both. Options given to attnkit's
methods override these defaults one by one. A field that would change the generated tokens and that
attnkit does not implement (beams, n-gram bans, suppressed or forced tokens, ...) is refused by name
when it holds anything but its neutral value, rather than ignored. The stop ids
(`eos_token_id`) are read with the tokenizer (`causal_checkpoint.read_hf_tokenizer`); the length
fields (`max_length`, `max_new_tokens`) are not read: how long to generate is the caller's
`max_new_tokens`, attnkit's own default.
"""

import numbers
import os

from attnkit.checkpoints.formats.json import read_json

# Fields of transformers' GenerationConfig that change which tokens come out, with their neutral
# values besides null, an empty list and an empty object.
_UNSUPPORTED = {
    "num_beams": (1,), "num_beam_groups": (1,), "penalty_alpha": (), "dola_layers": (), "top_h": (),
    "no_repeat_ngram_size": (0,), "encoder_no_repeat_ngram_size": (0,), "min_length": (0,), "min_new_tokens": (0,),
    "bad_words_ids": (), "force_words_ids": (), "constraints": (), "suppress_tokens": (), "begin_suppress_tokens": (),
    "forced_bos_token_id": (), "forced_eos_token_id": (), "sequence_bias": (), "typical_p": (1,), "min_p": (),
    "epsilon_cutoff": (0,), "eta_cutoff": (0,), "exponential_decay_length_penalty": (), "guidance_scale": (1,),
    "encoder_repetition_penalty": (1,), "watermarking_config": (), "stop_strings": (), "prompt_lookup_num_tokens": (),
    "max_time": (),
}


def read_generation_defaults(path):
    """{option: value} for `PretrainedCausalLM`'s generation methods from `path`/generation_config.json
    ({} when there is none): temperature (0 = greedy), top_k, top_p, repetition_penalty.

    Raises:
        ValueError: a field of the wrong type or range, or one attnkit does not implement, naming the
            file and the field.
    """
    file = os.path.join(path, "generation_config.json")
    settings = read_json(file, required=False)
    if settings is None:
        return {}
    for key, neutral in _UNSUPPORTED.items():
        value = settings.get(key)
        if value is not None and not _neutral(value, neutral):
            raise ValueError(f"{file}: `{key}` {value!r} is not supported: attnkit's generation does not implement it "
                             "(remove the field, or set it to null, to generate without it)")
    do_sample = _get(file, settings, "do_sample", lambda v: isinstance(v, bool), "a boolean", False)
    defaults = {}
    penalty = _get(file, settings, "repetition_penalty", lambda v: _number(v) and v > 0, "a finite number > 0", 1.0)
    if penalty != 1:
        defaults["repetition_penalty"] = float(penalty)
    if not do_sample:
        defaults["temperature"] = 0.0
        return defaults
    defaults["temperature"] = float(_get(file, settings, "temperature", lambda v: _number(v) and v > 0, "a finite number > 0", 1.0))
    top_k = _get(file, settings, "top_k", lambda v: _integer(v) and v >= 0, "an integer >= 0", 50)
    defaults["top_k"] = top_k or None  # 0: no top-k filter, as in transformers
    top_p = _get(file, settings, "top_p", lambda v: _number(v) and 0 < v <= 1, "a number in (0, 1]", 1.0)
    defaults["top_p"] = None if top_p == 1 else float(top_p)
    return defaults


def _neutral(value, neutral):
    if isinstance(value, (list, dict, str)):
        return not value
    return not isinstance(value, bool) and value in neutral


def _number(v):
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and abs(v) < float("inf")  # NaN compares False


def _integer(v):
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _get(file, settings, key, valid, expected, default):
    value = settings.get(key)
    if value is None:
        return default
    if not valid(value):
        raise ValueError(f"{file}: `{key}` must be {expected}. Received: {key}={value!r}")
    return value
