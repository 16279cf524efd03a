"""The OpenAI API's request bodies, checked field by field: a bad one is an `ApiError` (400) naming
the field, as the API's own error object does (docs/decisions.md item 117).

Fields that would change the output and are not implemented (tools, logprobs, penalties, n > 1, ...)
are refused by name rather than ignored; fields that change nothing here (user, metadata, store) are
accepted.
"""

import json
import numbers


class ApiError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with `status`."""

    def __init__(self, status, message, param=None, code=None, kind="invalid_request_error", headers=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self):
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad(param, message, code="invalid_value"):
    return ApiError(400, message, param=param, code=code)


def parse_json(raw):
    """The body as a JSON object."""
    try:
        body = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ApiError(400, f"The request body is not valid UTF-8 JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"The request body must be a JSON object. Received: {type(body).__name__}", code="invalid_json")
    for key, value in body.items():
        # JSON's \ud800 escape without its pair decodes to a str that is not text: the tokenizer raised
        # TypeError on it (a bare 500 from /v1/completions)
        try:
            json.dumps([key, value], ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            raise bad(key, f"`{key}` holds a lone UTF-16 surrogate escape ({e.object[e.start:e.end]!r}), which is not text.",
                      "invalid_json") from None
    return body


_IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key", "safety_identifier"}
# Fields accepted only at the value that changes nothing (the API's default).
_NEUTRAL = {
    "frequency_penalty": (0, None), "presence_penalty": (0, None), "logprobs": (False, None), "top_logprobs": (None, 0),
    "logit_bias": (None,), "tools": (None,), "tool_choice": (None, "none"), "functions": (None,), "response_format": (None,),
    "echo": (False, None), "best_of": (1, None), "suffix": (None,), "function_call": (None, "none"),
    "modalities": (None,), "prediction": (None,), "audio": (None,), "reasoning_effort": (None,),
}
_NEUTRAL["response_format"] += ({"type": "text"},)  # the API's default format, spelled out


def _neutral(value, defaults):
    """Whether `value` is one of `defaults` as JSON means it: a boolean is not a number (Python's
    0 == False, True == 1 would take the completions API's `logprobs: 0`, which asks for the sampled
    tokens' log probabilities, as `false`), while 0 and 0.0 are one number."""
    return any(value == d and isinstance(value, bool) == isinstance(d, bool) for d in defaults)
_SAMPLING = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream", "stream_options"}


def _check_fields(body, allowed):
    for key, value in body.items():
        if key in allowed or key in _IGNORED:
            continue
        if key in _NEUTRAL:
            if _neutral(value, _NEUTRAL[key]) or value in ({}, []):
                continue
            raise bad(key, f"`{key}` is not supported by this server (only its default). Received: {key}={value!r}", "unsupported_parameter")
        raise bad(key, f"Unknown field `{key}`.", "unknown_parameter")


def _typed(body, key, check, expected, default=None):
    value = body.get(key)
    if value is None:
        return default
    if not check(value):
        raise bad(key, f"`{key}` must be {expected}. Received: {key}={value!r}", "invalid_type")
    return value


def _integer(v):
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _number(v):
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and abs(v) < float("inf")


def model_name(body, known):
    name = body.get("model")
    if not isinstance(name, str):
        raise bad("model", f"`model` must be a string naming a model; this server has {sorted(known)}. Received: model={name!r}", "invalid_type")
    if name not in known:
        raise ApiError(404, f"The model `{name}` does not exist here; this server has {sorted(known)}.", "model", "model_not_found")
    return name


COMPLETION_MAX_TOKENS = 16  # `/v1/completions` without `max_tokens`


def sampling(body, chat):
    """{max_tokens, temperature, top_p, seed, stop, stream, include_usage} from a (chat) completion body."""
    options = {}
    length_key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    options["max_tokens"] = _typed(body, length_key, lambda v: _integer(v) and v >= 1, "an integer >= 1")
    if not chat and options["max_tokens"] is None:
        # OpenAI's completions API (and vLLM's) default to 16 tokens; chat's reply runs to its end
        options["max_tokens"] = COMPLETION_MAX_TOKENS
    options["max_tokens_field"] = length_key
    options["temperature"] = _typed(body, "temperature", lambda v: _number(v) and 0 <= v <= 2, "a number from 0 to 2")
    options["top_p"] = _typed(body, "top_p", lambda v: _number(v) and 0 < v <= 1, "a number in (0, 1]")
    options["seed"] = _typed(body, "seed", lambda v: _integer(v) and v >= 0, "an integer >= 0")
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop
    if stop is not None and not (isinstance(stops, list) and len(stops) <= 4 and all(isinstance(s, str) and s for s in stops)):
        raise bad("stop", f"`stop` must be a non-empty string or a list of up to 4 of them. Received: stop={stop!r}", "invalid_type")
    options["stop"] = stops or []
    n = _typed(body, "n", _integer, "an integer", 1)
    if n != 1:
        raise bad("n", f"`n` must be 1: this server returns one choice per request. Received: n={n}", "unsupported_value")
    options["stream"] = bool(_typed(body, "stream", lambda v: isinstance(v, bool), "a boolean", False))
    stream_options = _typed(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    if stream_options and not options["stream"]:
        raise bad("stream_options", "`stream_options` is only allowed with `stream: true`.")
    unknown = set(stream_options) - {"include_usage", "include_obfuscation"}
    if unknown:
        raise bad("stream_options", f"Unknown field(s) of `stream_options`: {sorted(unknown)}", "unknown_parameter")
    include = stream_options.get("include_usage", False)
    if not isinstance(include, bool):
        raise bad("stream_options", f"`stream_options.include_usage` must be a boolean. Received: {include!r}", "invalid_type")
    options["include_usage"] = include
    return options


def chat_messages(body):
    """`messages` as [{"role", "content": str}] for the chat template."""
    _check_fields(body, _SAMPLING | {"messages", "max_completion_tokens"})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", f"`messages` must be a non-empty list of messages. Received: messages={messages!r}"[:300],
                  "invalid_type" if not isinstance(messages, list) else "empty_array")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad(where, f"`{where}` must be an object with `role` and `content`. Received: {message!r}"[:300], "invalid_type")
        role, content = message.get("role"), message.get("content")
        if role not in ("system", "developer", "user", "assistant"):
            raise bad(f"{where}.role", f"`{where}.role` must be system, developer, user or assistant. Received: {role!r}")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise bad(f"{where}.content", f"`{where}.content` parts must be text parts {{\"type\": \"text\", \"text\": ...}}: "
                          "this server reads text only")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise bad(f"{where}.content", f"`{where}.content` must be a string. Received: {content!r}"[:300], "invalid_type")
        unknown = set(message) - {"role", "content", "name"}
        if unknown:
            raise bad(where, f"Unsupported field(s) of `{where}`: {sorted(unknown)}", "unsupported_parameter")
        out.append({"role": "system" if role == "developer" else role, "content": content})
        # `name` goes to the template as transformers passes it (was accepted and dropped: a template
        # that writes the speaker's name never saw it)
        name = message.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise bad(f"{where}.name", f"`{where}.name` must be a string. Received: {name!r}"[:300], "invalid_type")
            out[-1]["name"] = name
    return out


def completion_prompt(body):
    _check_fields(body, _SAMPLING | {"prompt"})
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise bad("prompt", f"`prompt` must be a string (one prompt per request). Received: prompt={prompt!r}"[:300], "invalid_type")
    if not prompt:
        raise bad("prompt", "`prompt` is empty.")
    return prompt


def embedding_inputs(body):
    """(texts, encoding_format) of an embeddings body."""
    _check_fields(body, {"model", "input", "encoding_format", "dimensions"})
    texts = body.get("input")
    texts = [texts] if isinstance(texts, str) else texts
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts):
        raise bad("input", "`input` must be a non-empty string or a non-empty list of non-empty strings (token ids are "
                  f"not supported). Received: input={body.get('input')!r}"[:300], "invalid_type")
    if len(texts) > 2048:
        raise bad("input", f"`input` holds {len(texts)} texts; at most 2048 per request.")
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise bad("encoding_format", f"`encoding_format` must be \"float\" or \"base64\". Received: {fmt!r}")
    if body.get("dimensions") is not None:
        raise bad("dimensions", "`dimensions` is not supported: the model's embeddings have one size.", "unsupported_parameter")
    return texts, fmt
