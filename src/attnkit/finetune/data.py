"""Fine-tuning data: JSON lines read, checked and tokenized, with the tokens the loss is taken on.

    {"messages": [{"role": ..., "content": ...}, ...]}   the model's chat template; loss on the assistant's turns
    {"prompt": str, "completion": str}                  loss on the completion (and the end token)
    {"text": str}                                       loss on every token (and the end token)

Every line is checked before training starts: a bad one is refused naming the file, its line number
and the field (docs/decisions.md item 120).

Legend: T tokens of one example.
"""

import json

import numpy as np

from attnkit.pipelines.chat_template import render_chat

IGNORE = -100  # transformers' ignore_index: a label the loss skips


def read_jsonl(path):
    """[(line number, dict)] of a JSON-lines file; blank lines are skipped, anything else must be a
    JSON object of one of the three forms (module docstring)."""
    examples = []
    with open(path, "rb") as f:  # bytes: a line that is not UTF-8 is refused naming it, like any other bad line
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")  # a byte-order mark (Notepad's) skipped
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}, line {number}: not UTF-8 text ({e.reason} at byte {e.start})") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}, line {number}: not valid JSON ({e})") from None
            examples.append((number, _checked(record, f"{path}, line {number}")))
    if not examples:
        raise ValueError(f"{path} holds no examples (one JSON object per line expected)")
    return examples


def _checked(record, where):
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object. Received: {type(record).__name__}")
    # "completion" belongs to "prompt" alone: beside "messages" or "text" it would be dropped without a word
    forms = [k for k in ("messages", "prompt", "text") if k in record]
    if len(forms) != 1 or ("completion" in record and forms != ["prompt"]):
        raise ValueError(
            f"{where}: expected exactly one of the fields \"messages\", \"prompt\" (with \"completion\") or \"text\". "
            f"Received the fields {sorted(record)}"
        )
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"{where}: field \"messages\" must be a non-empty list. Received: {messages!r:.80}")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"{where}: field \"messages\"[{i}] must be {{\"role\": str, \"content\": str}}. Received: {m!r:.80}")
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError(f"{where}: field \"messages\" has no \"assistant\" message: there is nothing to learn")
        return record
    names = ("prompt", "completion") if "prompt" in record else ("text",)
    for name in names:
        if not isinstance(record.get(name), str):
            raise ValueError(f"{where}: field \"{name}\" must be a string. Received: {record.get(name)!r:.80}")
    if not record[names[-1]]:
        raise ValueError(f"{where}: field \"{names[-1]}\" is empty: there is nothing to learn")
    return record


def assistant_spans(lm, messages):
    """(full text, [(start, end)] character spans of the assistant's turns) of a chat.

    An assistant turn is what the template adds between the chat up to it with the generation prompt
    and the chat including it: the reply and its end-of-turn tokens, as the model is to produce them."""
    full = render_chat(lm.chat_template, messages, add_generation_prompt=False, special_tokens=lm.special_tokens)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if i == 0:
            # No earlier chat renders what the template puts before this turn (SmolLM2's adds a default
            # system message): it would be learned as the reply's.
            raise ValueError("the chat opens with the assistant's turn, before which the template may add text of its own "
                             "(a default system message) that attnkit cannot tell apart from the reply; begin with a "
                             "system or user message")
        before = render_chat(lm.chat_template, messages[:i], add_generation_prompt=True, special_tokens=lm.special_tokens)
        upto = render_chat(lm.chat_template, messages[: i + 1], add_generation_prompt=False, special_tokens=lm.special_tokens)
        if not (full.startswith(upto) and upto.startswith(before)):
            # a template that renders earlier turns differently once later ones follow (Qwen3's thinking)
            raise ValueError("the chat template renders a turn differently once later turns follow; attnkit cannot "
                             "tell the assistant's tokens apart")
        spans.append((len(before), len(upto)))
    return full, spans


def encode(lm, record, max_length, where="example"):
    """(ids (T,) int32, labels (T,) int32) of one record: labels are the ids where the loss is taken,
    IGNORE elsewhere (the shift to next-token targets happens in `batches`).

    Raises:
        ValueError: a chat the template refuses, more than `max_length` tokens, no token to learn, or a
            prompt/completion or text example for a model without a stop token, naming `where`.
    """
    tok = lm.tokenizer
    end = lm.stop_ids[:1]  # the end token the model must learn to produce after a prompt/text
    if "messages" in record:
        try:
            full, spans = assistant_spans(lm, record["messages"])
        except (ValueError, TypeError) as e:  # the template's refusal ("roles must alternate"), named by its line
            raise ValueError(f"{where}: field \"messages\": {e}") from None
        encoding = tok.encode(full, add_special_tokens=False)  # as apply_chat_template tokenizes
        ids = list(encoding.ids)
        # a token is the assistant's when it starts inside an assistant span
        learn = [any(s <= start < e for s, e in spans) for start, _ in encoding.offsets]
    elif not end:
        # Without one the example would be learned with no end, silently: a model that never stops.
        raise ValueError(f"{where}: the model has no stop token (eos_token_id is null in its config.json or "
                         "generation_config.json), so a prompt/completion or text example cannot be taught to end; "
                         "set eos_token_id, or use the \"messages\" form, whose chat template ends each turn")
    elif "prompt" in record:
        prompt = tok.encode(record["prompt"]).ids
        completion = tok.encode(record["completion"], add_special_tokens=False).ids + end
        ids, learn = prompt + completion, [False] * len(prompt) + [True] * len(completion)
    else:
        ids = tok.encode(record["text"]).ids + end
        learn = [True] * len(ids)
    if len(ids) > max_length:
        raise ValueError(f"{where}: {len(ids)} tokens, more than --max-length {max_length}; shorten it or raise --max-length")
    if not any(learn[1:]):  # the first token is never a target
        raise ValueError(f"{where}: no token to learn from after tokenization")
    ids = np.asarray(ids, "int32")
    return ids, np.where(learn, ids, IGNORE).astype("int32")


def encode_file(lm, path, max_length):
    """[(ids, labels)] of every line of `path`, all checked before any is used."""
    return [encode(lm, record, max_length, f"{path}, line {number}") for number, record in read_jsonl(path)]


def batch_order(n, batch_size, seed, epoch):
    """The example indices of each batch of `epoch`: a permutation fixed by (seed, epoch), so a resumed
    run takes the same batches; the last batch may be smaller."""
    order = np.random.default_rng([seed, epoch]).permutation(n)
    return [order[i : i + batch_size] for i in range(0, n, batch_size)]


def collate(examples, pad_id, multiple=8):
    """(inputs (B, L), targets (B, L)) for next-token training: inputs are ids[:-1], targets ids[1:] with
    IGNORE where no loss is taken and on the padding. Padding goes on the right, where causal attention
    never reaches a real token, so no attention mask is needed; L is rounded up to a multiple of
    `multiple` so that jax and tensorflow trace few shapes."""
    length = max(len(ids) - 1 for ids, _ in examples)
    length = -(-length // multiple) * multiple
    inputs = np.full((len(examples), length), pad_id, "int32")
    targets = np.full((len(examples), length), IGNORE, "int32")
    for row, (ids, labels) in enumerate(examples):
        inputs[row, : len(ids) - 1] = ids[:-1]
        targets[row, : len(ids) - 1] = labels[1:]
    return inputs, targets
