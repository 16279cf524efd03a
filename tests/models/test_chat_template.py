"""`render_chat` against transformers' `apply_chat_template` on a tiny tokenizer built at test time:
the same variables, tags, globals and filters, the same messages accepted, every failure a ValueError."""

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("jinja2")

from attnkit.pipelines.chat_template import render_chat  # noqa: E402

SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, models

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    return transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")), **SPECIAL)


def _transformers(tokenizer, template, messages, **options):
    return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True, **options)


def _attnkit(template, messages, **options):
    return render_chat(template, messages, special_tokens=SPECIAL, **options)


TEMPLATES = {
    # tools and documents are None unless given: undefined, `is not none` held and the block rendered
    "tools": "{% if tools is not none %}[TOOLS]{{ tools|tojson }}[/TOOLS]{% endif %}{% if documents is none %}no documents{% endif %}"
             "{% for m in messages %}{{ bos_token }}{{ m.role }}: {{ m.content }}{{ eos_token }}{% endfor %}",
    # the training-mask tag renders its body, in its own scope
    "generation": "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% set x = 1 %}"
                  "{% endgeneration %}{% else %}{{ m.content }}{% endif %}{{ x is defined }}{% endfor %}",
    # a message's None values are dropped: templates test for a missing key
    "defined": "{% for m in messages %}{{ m.role }}{% if m.content is defined %}={{ m.content }}{% endif %}"
               "{% if m.tool_calls is defined %}{{ m.tool_calls|tojson(indent=2, sort_keys=true) }}{% endif %};{% endfor %}",
    "globals": "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{{ dict(role=m.role)|tojson }}"
               "{% endfor %}{{ ns.n }}{% if add_generation_prompt %}<assistant>{% endif %}",
}
MESSAGES = [
    {"role": "system", "content": "Be <brief> & \"exact\""},
    {"role": "user", "content": "Héllo"},
    {"role": "assistant", "content": None, "tool_calls": [{"name": "f", "arguments": {"x": 1}}]},
    {"role": "tool", "content": 42},  # content is the template's to read, a number too
]
OPTIONS = [{}, {"tools": [{"type": "function", "function": {"name": "f"}}], "documents": [{"title": "t", "text": "x"}]}]


def _without_none(messages):
    return [{key: value for key, value in m.items() if value is not None} for m in messages]


@pytest.mark.parametrize("options", OPTIONS, ids=["without tools", "with tools"])
@pytest.mark.parametrize("name", list(TEMPLATES))
def test_renders_as_transformers(tokenizer, name, options):
    # transformers 5.24 drops a message's None values, 5.17 rendered "None"; attnkit drops them
    # (the next test), so transformers is given them dropped whatever its version
    expected = _transformers(tokenizer, TEMPLATES[name], _without_none(MESSAGES), **options)
    assert _attnkit(TEMPLATES[name], MESSAGES, **options) == expected


def test_a_messages_none_values_are_dropped_as_transformers_drops_them():
    """An assistant turn with tool calls has content None: templates test whether the key is defined."""
    assert _attnkit(TEMPLATES["defined"], MESSAGES[1:3]) == 'user=Héllo;assistant[\n  {\n    "arguments": {\n      "x": 1\n    },\n    "name": "f"\n  }\n];'


def test_an_empty_conversation_is_refused_as_transformers_refuses_it(tokenizer):
    with pytest.raises(ValueError, match="empty conversation"):
        _transformers(tokenizer, TEMPLATES["tools"], [])
    with pytest.raises(ValueError, match=r"`messages` is empty: a chat needs at least one message"):
        _attnkit(TEMPLATES["tools"], [])


CONCATENATING = "{% for m in messages %}{{ '<' + m.role + '>' + m.content }}{% endfor %}"


@pytest.mark.parametrize("template, messages, cause, match", [
    # transformers drops content None, so `+` meets an undefined value
    (CONCATENATING, [{"role": "user", "content": None}], "UndefinedError", "has no attribute 'content'"),
    ("{{ messages[0].nothing|tojson }}", [{"role": "user", "content": "x"}], "TypeError", "not JSON serializable"),
    ("{{ messages[0].content + 1 }}", [{"role": "user", "content": "x"}], "TypeError", "can only concatenate str"),
    ("{{ messages[0].content[5].text }}", [{"role": "user", "content": ["a"]}], "UndefinedError", "list object has no element 5"),
])
def test_every_rendering_failure_is_a_value_error_keeping_its_cause(tokenizer, template, messages, cause, match):
    with pytest.raises(Exception):  # transformers fails too (content None: a TypeError before it dropped None values)
        _transformers(tokenizer, template, messages)
    with pytest.raises(ValueError, match=rf"The chat template failed while rendering the messages: {cause}: .*{match}") as raised:
        _attnkit(template, messages)
    assert type(raised.value.__cause__).__name__ == cause


def test_the_templates_own_refusal_and_a_syntax_error_are_named():
    with pytest.raises(ValueError, match="The chat template refused the messages: roles must alternate"):
        _attnkit("{{ raise_exception('roles must alternate') }}", [{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match=r"The chat template is not valid Jinja: .*'endfor'.* \(line 1\)"):
        _attnkit("{% for m in messages %}", [{"role": "user", "content": "x"}])


@pytest.mark.parametrize("messages, match", [
    ({"role": "user", "content": "x"}, r"`messages` must be a list of .* Received: messages of type dict"),
    ([{"role": "user", "content": "x"}, "hello"], r"`messages\[1\]` must be a \{'role': \.\.\., 'content': \.\.\.\} dict\. Received: 'hello'"),
    ([{"content": "x"}], r"`messages\[0\]\['role'\]` must be a str\. Received: role=None"),
    ([{"role": "user", "content": "x"}, {"role": 1, "content": "x"}], r"`messages\[1\]\['role'\]` must be a str\. Received: role=1"),
])
def test_malformed_messages_are_refused_by_index_and_field(messages, match):
    with pytest.raises(ValueError, match=match):
        _attnkit(TEMPLATES["tools"], messages)


@pytest.mark.parametrize("options, match", [
    ({"tools": [lambda x: x]}, r"`tools` must be None or a list of JSON-schema dicts"),
    ({"documents": "text"}, r"`documents` must be None or a list of dicts\. Received: documents='text'"),
])
def test_malformed_tools_and_documents_are_refused_by_name(options, match):
    with pytest.raises(ValueError, match=match):
        _attnkit(TEMPLATES["tools"], [{"role": "user", "content": "x"}], **options)
