"""generation_config.json as the defaults of the generation methods, as transformers' `generate` reads
it; the repetition penalty against transformers (docs/decisions.md item 88). Random llama directories
saved at test time."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from attnkit.cli import build_parser  # noqa: E402
from attnkit.cli import generation as cli_generation  # noqa: E402
from attnkit.pipelines.causal_checkpoint import load_causal_lm  # noqa: E402

SMALL = dict(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2)
PROMPTS = [[5, 6, 7, 8, 9], [10, 11]]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama")
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)).eval().save_pretrained(path)
    return str(path)


def _with_generation_config(saved, tmp_path, **fields):
    """A copy of `saved` whose generation_config.json holds its own fields and `fields`."""
    import shutil

    path = shutil.copytree(saved, tmp_path / "model")
    file = path / "generation_config.json"
    settings = json.loads(file.read_text()) if file.exists() else {}
    file.write_text(json.dumps({**settings, **fields}))
    return str(path)


def _transformers_greedy(path, prompt, **options):
    ref = transformers.LlamaForCausalLM.from_pretrained(path).eval()  # reads generation_config.json
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=12, eos_token_id=None, pad_token_id=0, **options)
    return out[0, len(prompt):].tolist()


def test_the_files_repetition_penalty_applies_to_greedy_decoding_as_in_transformers(saved, tmp_path):
    path = _with_generation_config(saved, tmp_path, repetition_penalty=1.5)
    lm = load_causal_lm(path)
    assert lm.generation_defaults == {"repetition_penalty": 1.5, "temperature": 0.0}
    ours = lm.generate_ids(PROMPTS, max_new_tokens=12, stop_tokens=[])  # batched, left padded
    for prompt, out in zip(PROMPTS, ours):
        assert out == _transformers_greedy(path, prompt)
    assert ours != lm.generate_ids(PROMPTS, max_new_tokens=12, stop_tokens=[], repetition_penalty=1.0)  # it changed them


@pytest.mark.parametrize("penalty", [0.7, 1.3])
def test_an_explicit_repetition_penalty_matches_transformers(saved, penalty):
    lm = load_causal_lm(saved)
    ours = lm.generate_ids([PROMPTS[0]], max_new_tokens=12, stop_tokens=[], repetition_penalty=penalty)[0]
    assert ours == _transformers_greedy(saved, PROMPTS[0], do_sample=False, repetition_penalty=penalty)
    # 6 tokens: the uncached path compiles once per length on jax.
    cached = lm.generate_ids(PROMPTS, max_new_tokens=6, stop_tokens=[], repetition_penalty=penalty, temperature=0.8, seed=1)
    assert cached == lm.generate_ids(PROMPTS, max_new_tokens=6, stop_tokens=[], repetition_penalty=penalty, temperature=0.8,
                                     seed=1, use_cache=False)


@pytest.mark.parametrize("fields, defaults", [
    (dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.8), dict(temperature=0.7, top_k=20, top_p=0.8)),
    (dict(do_sample=True), dict(temperature=1.0, top_k=50, top_p=None)),  # transformers' own defaults
    (dict(do_sample=True, top_k=0, top_p=1.0), dict(temperature=1.0, top_k=None, top_p=None)),  # 0 and 1: no filter
    (dict(do_sample=False, temperature=0.7, top_k=20), dict(temperature=0.0)),  # greedy: the rest unused
    (dict(num_beams=1, typical_p=1.0, suppress_tokens=[], guidance_scale=None, max_length=4096, min_new_tokens=0),
     dict(temperature=0.0)),  # neutral values of what attnkit does not implement
])
def test_the_files_decoding_strategy_is_the_default(saved, tmp_path, fields, defaults):
    lm = load_causal_lm(_with_generation_config(saved, tmp_path, **fields))
    assert lm.generation_defaults == defaults
    sampled = lm.generate_ids(PROMPTS, max_new_tokens=8, stop_tokens=[], seed=5)
    assert sampled == lm.generate_ids(PROMPTS, max_new_tokens=8, stop_tokens=[], seed=5, **defaults)


def test_options_given_override_the_file(saved, tmp_path):
    path = _with_generation_config(saved, tmp_path, do_sample=True, temperature=0.7, top_k=20)
    lm = load_causal_lm(path)
    greedy = lm.generate_ids([PROMPTS[0]], max_new_tokens=12, stop_tokens=[], temperature=0)[0]
    assert greedy == _transformers_greedy(path, PROMPTS[0], do_sample=False)


@pytest.mark.parametrize("fields, match", [
    (dict(num_beams=4), r"generation_config.json: `num_beams` 4 is not supported"),
    (dict(no_repeat_ngram_size=3), r"`no_repeat_ngram_size` 3 is not supported"),
    (dict(suppress_tokens=[5]), r"`suppress_tokens` \[5\] is not supported"),
    (dict(min_new_tokens=2), r"`min_new_tokens` 2 is not supported"),
    (dict(forced_eos_token_id=2), r"`forced_eos_token_id` 2 is not supported"),
    (dict(do_sample=True, temperature=0), r"`temperature` must be a finite number > 0\. Received: temperature=0"),
    (dict(do_sample=True, top_p=1.5), r"`top_p` must be a number in \(0, 1\]\. Received: top_p=1.5"),
    (dict(do_sample="true"), r"`do_sample` must be a boolean\. Received: do_sample='true'"),
    (dict(repetition_penalty=0), r"`repetition_penalty` must be a finite number > 0\. Received: repetition_penalty=0"),
    (dict(repetition_penalty=float("inf")), r"`repetition_penalty` must be a finite number > 0\. Received: repetition_penalty=inf"),
])
def test_what_would_change_the_tokens_and_is_not_implemented_is_refused_by_name(saved, tmp_path, fields, match):
    with pytest.raises(ValueError, match=match):
        load_causal_lm(_with_generation_config(saved, tmp_path, **fields))


@pytest.mark.parametrize("penalty", [0, -1.0, float("nan"), float("inf"), True, "1.2"])
def test_a_bad_repetition_penalty_is_refused_by_name(saved, penalty):
    with pytest.raises(ValueError, match=r"`repetition_penalty` must be a finite number > 0"):
        load_causal_lm(saved).generate_ids([[1, 2]], max_new_tokens=2, repetition_penalty=penalty)


def test_the_commands_sampling_options_default_to_the_model(capsys):
    import types

    greedy, sampling = types.SimpleNamespace(generation_defaults={}), types.SimpleNamespace(generation_defaults={"temperature": 0.7})
    args = build_parser().parse_args(["generate", "hi"])
    assert "temperature" not in cli_generation._options(args, sampling) and "top_k" not in cli_generation._options(args, sampling)
    args = build_parser().parse_args(["generate", "hi", "--top-k", "3"])
    assert cli_generation._options(args, sampling)["top_k"] == 3 and "temperature" not in cli_generation._options(args, sampling)
    assert capsys.readouterr().err == ""
    args = build_parser().parse_args(["generate", "hi", "--temperature", "0", "--top-k", "3"])
    assert cli_generation._options(args, sampling) == dict(max_new_tokens=128, temperature=0)  # greedy: top-k named, dropped (item 108)
    assert "--top-k has no effect: generation is greedy (--temperature 0)" in capsys.readouterr().err
    assert "top_k" not in cli_generation._options(build_parser().parse_args(["generate", "hi", "--top-k", "3"]), greedy)


@pytest.mark.parametrize("file, text, match", [
    ("generation_config.json", "{not json", r"generation_config.json: not valid JSON"),
    ("generation_config.json", "[1, 2]", r"generation_config.json: expected a JSON object\. Received: list"),
    ("tokenizer_config.json", "[1, 2]", r"tokenizer_config.json: expected a JSON object\. Received: list"),  # was AttributeError
    ("config.json", "{not json", r"config.json: not valid JSON"),
])
def test_a_json_file_that_is_not_an_object_is_refused_naming_it(saved, tmp_path, file, text, match):
    path = _with_generation_config(saved, tmp_path)
    (tmp_path / "model" / file).write_text(text)
    with pytest.raises(ValueError, match=match):
        load_causal_lm(path)
