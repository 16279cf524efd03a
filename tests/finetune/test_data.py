"""The fine-tuning data: which tokens the loss is taken on, and bad lines refused by line and field."""

import json

import numpy as np
import pytest
from backend_utils import once_per_run

transformers = pytest.importorskip("transformers")
pytestmark = once_per_run  # tokenization: the same on every backend

from attnkit.finetune import data  # noqa: E402
from attnkit.pipelines.causal_checkpoint import load_causal_lm  # noqa: E402
from tiny import TEMPLATE, write_jsonl  # noqa: E402

# The test template marks the assistant's turns as transformers' assistant mask reads them.
TAGGED = TEMPLATE.replace(
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}",
    "{% if message['role'] == 'assistant' %}{{'<|im_start|>assistant\n'}}{% generation %}{{ message['content'] + '<|im_end|>\n' }}"
    "{% endgeneration %}{% else %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}{% endif %}",
)
CHATS = [
    [{"role": "user", "content": "Normalise: 3/3/21"}, {"role": "assistant", "content": "2021-03-03"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello!"},
     {"role": "user", "content": "and 4.5.1999?"}, {"role": "assistant", "content": "1999-05-04"}],
]


@pytest.fixture(scope="module")
def lm(tiny_dir):
    lm = load_causal_lm(tiny_dir)
    assert TAGGED != TEMPLATE
    lm.chat_template = TAGGED
    return lm


@pytest.mark.parametrize("messages", CHATS)
def test_chat_mask_is_transformers_assistant_mask(lm, tiny_dir, messages):
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    reference = tokenizer.apply_chat_template(messages, chat_template=TAGGED, tokenize=True, return_dict=True,
                                              return_assistant_tokens_mask=True)
    ids, labels = data.encode(lm, {"messages": messages}, 512)
    assert ids.tolist() == list(reference["input_ids"])
    learned = (labels != data.IGNORE).astype(int).tolist()
    assert learned == list(reference["assistant_masks"])  # token by token
    # the reply's bytes, <|im_end|> and the newline: each reply's own tokens and nothing else
    assert sum(learned) == sum(len(m["content"]) + 2 for m in messages if m["role"] == "assistant")


def test_prompt_completion_and_text(lm):
    ids, labels = data.encode(lm, {"prompt": "Q: ", "completion": "A"}, 64)
    end = lm.stop_ids[0]
    assert ids.tolist() == lm.encode("Q: ") + lm.encode("A", add_special_tokens=False) + [end]
    assert labels.tolist() == [data.IGNORE] * len(lm.encode("Q: ")) + lm.encode("A", add_special_tokens=False) + [end]
    ids, labels = data.encode(lm, {"text": "abc"}, 64)
    assert labels.tolist() == ids.tolist() == lm.encode("abc") + [end]


def test_collate_shifts_and_pads_on_the_right():
    ids, labels = np.array([5, 6, 7, 8], "int32"), np.array([-100, -100, 7, 8], "int32")
    inputs, targets = data.collate([(ids, labels), (ids[:2], np.array([-100, 6], "int32"))], pad_id=0, multiple=4)
    assert inputs.tolist() == [[5, 6, 7, 0], [5, 0, 0, 0]]
    assert targets.tolist() == [[-100, 7, 8, -100], [6, -100, -100, -100]]


@pytest.mark.parametrize("line, message", [
    ("{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}]}", "line 2: field \"messages\" has no \"assistant\""),
    ("{\"prompt\": \"x\"}", "line 2: field \"completion\" must be a string"),
    ("{\"text\": 3}", "line 2: field \"text\" must be a string"),
    ("{\"messages\": [{\"role\": \"user\"}]}", "line 2: field \"messages\"[0] must be"),
    ("[1, 2]", "line 2: expected a JSON object"),
    ("{\"text\": \"a\", \"prompt\": \"b\"}", "line 2: expected exactly one of the fields"),
    # a completion beside text or messages was dropped without a word
    ("{\"text\": \"a\", \"completion\": \"b\"}", "line 2: expected exactly one of the fields"),
    ("{\"messages\": [{\"role\": \"assistant\", \"content\": \"x\"}], \"completion\": \"b\"}",
     "line 2: expected exactly one of the fields"),
    ("{\"completion\": \"b\"}", "line 2: expected exactly one of the fields"),
    ("{\"text\": \"a\"", "line 2: not valid JSON"),
])
def test_bad_line_is_refused_with_its_number_and_field(tmp_path, line, message):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=None) as raised:
        data.read_jsonl(str(path))
    assert message in str(raised.value) and str(path) in str(raised.value)


def test_too_long_example_is_refused(lm, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "short"}, {"text": "x" * 40}])
    with pytest.raises(ValueError, match=r"line 2: 41 tokens, more than --max-length 16"):
        data.encode_file(lm, path, 16)


def test_a_line_that_is_not_utf8_is_refused_by_its_number_and_a_bom_is_skipped(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"text": "fine"}\n{"text": "caf\xe9"}\n')  # a byte-order mark, then Latin-1
    with pytest.raises(ValueError, match=r"d\.jsonl, line 2: not UTF-8 text"):
        data.read_jsonl(str(path))
    path.write_bytes(b'\xef\xbb\xbf{"text": "fine"}\n')
    assert data.read_jsonl(str(path)) == [(1, {"text": "fine"})]


def test_a_chat_the_template_refuses_is_refused_by_its_line(lm, tmp_path):
    strict = load_causal_lm(lm.path)
    strict.chat_template = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}" + TEMPLATE
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "fine"}, {"messages": [
        {"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}])
    with pytest.raises(ValueError, match=r"d\.jsonl, line 2: field \"messages\": .*System role not supported"):
        data.encode_file(strict, path, 256)


def test_a_chat_opening_with_the_assistant_is_refused_by_its_line(lm, tmp_path):
    """The template adds its default system message before a first assistant turn: no earlier chat
    renders that prefix, so the reply could not be told apart from it (all 40 tokens were learned)."""
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": CHATS[0]}, {"messages": [{"role": "assistant", "content": "hi"}]}])
    with pytest.raises(ValueError, match=r"d\.jsonl, line 2: field \"messages\": the chat opens with the assistant's turn"):
        data.encode_file(lm, path, 256)


def test_prompt_completion_and_text_are_refused_without_a_stop_token(lm, tmp_path):
    """They were learned with no end token, silently: a model taught never to stop."""
    stops = lm.stop_ids
    lm.stop_ids = []
    try:
        for record in ({"prompt": "Q: ", "completion": "A"}, {"text": "abc"}):
            with pytest.raises(ValueError, match="line 3: the model has no stop token"):
                data.encode(lm, record, 64, "d.jsonl, line 3")
        data.encode(lm, {"messages": CHATS[0]}, 512)  # the template ends the turn
    finally:
        lm.stop_ids = stops
