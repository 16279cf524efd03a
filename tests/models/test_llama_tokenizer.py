"""LlamaTokenizer rebuilt as transformers 5 rebuilds a sentencepiece-converted tokenizer.json
(docs/decisions.md item 95): ids, offsets and decoding against AutoTokenizer over random texts, for
`legacy` / `add_prefix_space` variants, both layouts older conversions wrote, and the mistral model type
(the file as it is); a whole llama directory loads, renders and tokenizes chats and generates as
transformers does; the classes and values not replicated are refused by name."""

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from attnkit.pipelines.causal_checkpoint import load_causal_lm, read_hf_tokenizer  # noqa: E402

CORPUS = ["the cat sat on the mat", "hello world", "Hello there, world!", "café naïve", "def f(x):\n    return x+1",
          "  two  spaces", "I'm here. You're there."] * 4
BYTE_TOKENS = [f"<0x{i:02X}>" for i in range(256)]
# leading spaces, runs of spaces, newlines, characters outside the vocabulary (byte fallback), the special
# tokens spelled inside words, a literal "▁", an added chat token in another case
PIECES = ["hello", " world", "the", "cat", "mat", "Hello", " there", ",", "!", "'", " ", "  ", "   ", "\n", "\n\n", "\t",
          "</s>", "<s>", "<unk>", "<|user|>", "<|USER|>", "[PAD]", "▁", "é", "naïve", "😀", "東京", "\x00", "\u200b", "x+1"]
TEXTS = st.lists(st.sampled_from(PIECES) | st.text(max_size=3), max_size=12).map("".join)
FLAGS = dict(lstrip=False, rstrip=False, single_word=False)
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{{ eos_token }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}{% if pad_token is defined %}{{ pad_token }}{% endif %}")


def _sentencepiece_file(layout="normalizer"):
    """A Llama-2 style tokenizer.json: BPE with byte fallback over "▁"-words, <unk> <s> </s> and the 256
    byte tokens first, "<s> $A"; the Prepend + Replace normalizer older conversions wrote, or the
    Metaspace pre-tokenizer of later ones."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always", split=True)
    tokenizer.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"] + BYTE_TOKENS, show_progress=False))
    if layout == "normalizer":
        tokenizer.pre_tokenizer = None
        tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    return tokenizer


def _tinyllama_settings(**extra):
    """TinyLlama-chat's tokenizer_config.json: added_tokens_decoder, a chat token added as a new word,
    add_bos_token (which transformers drops beside a tokenizer.json), sp_model_kwargs, pad_token null."""
    decoder = {str(i): {"content": text, "normalized": False, "special": True, **FLAGS}
               for i, text in enumerate(["<unk>", "<s>", "</s>"])}
    decoder["400"] = {"content": "<|user|>", "normalized": False, "special": False, **FLAGS}  # gets the next free id
    return {"tokenizer_class": "LlamaTokenizer", "added_tokens_decoder": decoder, "add_bos_token": True,
            "add_eos_token": False, "pad_token": None, "sp_model_kwargs": {}, "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE, **extra}


def _no_post_processor(tokenizer):
    tokenizer.post_processor = None  # transformers gives it "$A": neither <s> nor add_bos_token's
    return tokenizer


def _truncating(tokenizer):
    tokenizer.enable_truncation(6)  # switched off by transformers' __call__ unless asked
    tokenizer.enable_padding(length=40)  # and its pad_token "[PAD]" is added
    return tokenizer


# name: (tokenizer_config.json, config.json, layout, change of the file)
VARIANTS = {
    "legacy absent": ({"tokenizer_class": "LlamaTokenizerFast"}, {}, "normalizer", None),
    "legacy true": ({"tokenizer_class": "LlamaTokenizerFast", "legacy": True}, {}, "normalizer", None),
    "legacy false": ({"tokenizer_class": "LlamaTokenizerFast", "legacy": False}, {}, "normalizer", None),
    "legacy and add_prefix_space null": ({"tokenizer_class": "LlamaTokenizer", "legacy": None, "add_prefix_space": None},
                                         {}, "normalizer", None),
    "add_prefix_space false": ({"tokenizer_class": "LlamaTokenizer", "add_prefix_space": False, "legacy": True}, {},
                               "normalizer", None),
    "add_prefix_space true, legacy true, add_eos_token": (
        {"tokenizer_class": "LlamaTokenizer", "add_prefix_space": True, "legacy": True, "add_eos_token": True}, {},
        "metaspace", None),
    "metaspace layout": ({"tokenizer_class": "LlamaTokenizerFast", "legacy": False}, {}, "metaspace", None),
    "tinyllama": (_tinyllama_settings(), {}, "normalizer", None),
    "tinyllama legacy, another bos": (_tinyllama_settings(legacy=True, bos_token="<|user|>"), {}, "normalizer", None),
    "split_special_tokens": (_tinyllama_settings(split_special_tokens=True), {}, "normalizer", None),
    "no post-processor, add_bos_token": ({"tokenizer_class": "LlamaTokenizer", "add_bos_token": True}, {}, "normalizer",
                                         _no_post_processor),
    "truncation and padding in the file": ({"tokenizer_class": "LlamaTokenizer"}, {}, "normalizer", _truncating),
    "class named in config.json": ({}, {"tokenizer_class": "LlamaTokenizerFast"}, "normalizer", None),
    "mistral: the file as it is": ({"tokenizer_class": "LlamaTokenizerFast", "legacy": True}, {"model_type": "mistral"},
                                   "normalizer", None),
    "PreTrainedTokenizerFast: as it is, truncation in the file": ({"tokenizer_class": "PreTrainedTokenizerFast"}, {},
                                                                  "normalizer", _truncating),
}


def _directory(path, settings, config, layout="normalizer", change=None):
    tokenizer = _sentencepiece_file(layout)
    if change is not None:
        tokenizer = change(tokenizer)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(settings))
    config = {"model_type": "llama", **config}
    (path / "config.json").write_text(json.dumps(config))
    return config


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_tokenizer") / "model"
    config = _directory(path, *VARIANTS[request.param])
    return read_hf_tokenizer(str(path), config)[0], transformers.AutoTokenizer.from_pretrained(str(path))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXTS)
def test_ids_offsets_and_decoding_match_transformers(pair, text):
    ours, reference = pair
    expected = reference(text, return_offsets_mapping=True)
    encoding = ours.encode(text)
    assert encoding.ids == expected["input_ids"]
    assert [tuple(o) for o in encoding.offsets] == [tuple(o) for o in expected["offset_mapping"]]
    assert ours.encode(text, add_special_tokens=False).ids == reference(text, add_special_tokens=False)["input_ids"]
    for skip in (True, False):
        assert ours.decode(encoding.ids, skip_special_tokens=skip) == reference.decode(
            expected["input_ids"], skip_special_tokens=skip)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(attnkit's PretrainedCausalLM, transformers' model, AutoTokenizer) of a random-init llama directory
    with TinyLlama's tokenizer files (eos_token, bos_token from the class's defaults)."""
    path = tmp_path_factory.mktemp("llama_model") / "model"
    _directory(path, _tinyllama_settings(legacy=False), {})
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=401, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2)
    reference = transformers.LlamaForCausalLM(config).eval()
    reference.save_pretrained(path)
    return load_causal_lm(str(path)), reference, transformers.AutoTokenizer.from_pretrained(str(path))


MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]), "content": TEXTS}),
                    min_size=1, max_size=3)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=MESSAGES)
def test_a_chat_is_rendered_and_tokenized_as_transformers(llama, messages):
    lm, _, reference = llama
    expected = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert lm.chat_prompt(messages) == expected  # <s> and </s> from LlamaTokenizer's defaults, no pad_token
    assert lm.chat_ids(messages) == reference.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]


def test_a_llama_directory_generates_as_transformers(llama):
    lm, model, reference = llama
    prompt = " Hello  world\n</s>café"
    ids = lm.encode(prompt)
    assert ids == reference(prompt)["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=2, pad_token_id=2)
    new = out[0, len(ids):].tolist()  # 8 tokens, none of them </s>
    assert [int(t) for t in lm.generate_ids([ids], max_new_tokens=8)[0]] == new
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits.numpy()
    np.testing.assert_allclose(lm.logits(ids), expected, atol=2e-4)
    assert lm.generate(prompt, max_new_tokens=8) == reference.decode(new, skip_special_tokens=True)


@pytest.mark.parametrize("class_name, change, expected", [
    ("PreTrainedTokenizerFast", None, "||False|False|hi"),
    ("LlamaTokenizer", None, "|</s>|True|False|hi"),  # the class's defaults
    ("PreTrainedTokenizerFast", _truncating, "||False|True|hi"),  # the pad token of the file's padding
], ids=["as it is", "LlamaTokenizer", "padding in the file"])
def test_the_chat_template_gets_the_special_tokens_transformers_gives_it(tmp_path, class_name, change, expected):
    # bos_token null and pad_token unset are undefined there, not "None"
    from types import SimpleNamespace

    from attnkit.pipelines.causal_lm import PretrainedCausalLM

    settings_ = {"tokenizer_class": class_name, "bos_token": None, "chat_template": "{{ bos_token }}|{{ eos_token }}|"
                 "{{ unk_token is defined }}|{{ pad_token is defined }}|{{ messages[0].content }}"}
    config = _directory(tmp_path, settings_, {}, change=change)
    _, template, special, _ = read_hf_tokenizer(str(tmp_path), config)
    no_model = SimpleNamespace(n=1, h=1, d_model=1)  # the chat's text needs no weights
    lm = PretrainedCausalLM(no_model, None, chat_template=template, special_tokens=special)
    messages = [{"role": "user", "content": "hi"}]
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path)).apply_chat_template(messages, tokenize=False)
    assert lm.chat_prompt(messages, add_generation_prompt=False) == reference == expected


@pytest.mark.parametrize("settings_, config, match", [
    ({"tokenizer_class": "CodeLlamaTokenizerFast"}, {},
     r"tokenizer_class 'CodeLlamaTokenizerFast': transformers rebuilds tokenizer\.json as CodeLlamaTokenizer"),
    ({"tokenizer_class": "LlamaTokenizerFast"}, {"model_type": "qwen2"},
     r"tokenizer_class 'LlamaTokenizerFast': transformers rebuilds tokenizer\.json as Qwen2Tokenizer \(model_type 'qwen2'\)"),
    ({"tokenizer_class": "LlamaTokenizer", "legacy": "false"}, {}, r"`legacy` must be null, true or false"),
    ({"tokenizer_class": "LlamaTokenizer", "add_prefix_space": 1}, {}, r"`add_prefix_space` must be null, true or false"),
    ({"tokenizer_class": "LlamaTokenizer", "clean_up_tokenization_spaces": True,
      "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output": True}, {},
     r"clean_up_tokenization_spaces=true: transformers removes the spaces before punctuation"),
    ({"clean_up_tokenization_spaces": "no"}, {}, r"`clean_up_tokenization_spaces` must be true or false"),
], ids=["CodeLlamaTokenizer", "qwen2", "legacy", "add_prefix_space", "clean_up", "clean_up type"])
def test_what_is_not_replicated_is_refused_by_name(tmp_path, settings_, config, match):
    config = _directory(tmp_path, settings_, config)
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: " + match):
        read_hf_tokenizer(str(tmp_path), config)


def test_clean_up_of_a_bpe_model_alone_is_what_transformers_does_not_do(tmp_path):
    # transformers skips the clean-up for a BPE model unless the second flag says otherwise
    config = _directory(tmp_path, {"tokenizer_class": "LlamaTokenizer", "clean_up_tokenization_spaces": True}, {})
    ours = read_hf_tokenizer(str(tmp_path), config)[0]
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ids = reference("Hello, world .")["input_ids"]
    assert ours.decode(ids, skip_special_tokens=False) == reference.decode(ids) == "<s> Hello, world ."
