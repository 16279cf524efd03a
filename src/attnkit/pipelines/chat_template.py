"""Chat templates: a model's Jinja template rendered as transformers' `apply_chat_template` renders it.

The same sandboxed environment (trim_blocks, lstrip_blocks, loop controls, the `{% generation %}`
tag), the same globals (`raise_exception`, `strftime_now`, `dict`, `namespace`) and `tojson` filter,
the same variables (`messages`, `tools` and `documents`, None unless given, `add_generation_prompt`,
the special tokens) and the same messages (keys whose value is None dropped).
"""

import functools
import json
from datetime import datetime

from attnkit._validation import ArgumentTypeError


def render_chat(template, messages, *, add_generation_prompt=True, special_tokens=None, tools=None, documents=None, **extra):
    """The prompt text for `messages`.

    Args:
        template: the Jinja source.
        messages: a non-empty list of {"role": str, "content": ...} dicts (further keys
            such as "tool_calls" are passed on; a None value is dropped, as transformers drops it).
        add_generation_prompt: end with the assistant's turn header. Default True.
        special_tokens: {"bos_token": ..., "eos_token": ..., ...} made available to the template.
        tools: None (default) or a list of JSON-schema dicts, the template's `tools`.
        documents: None (default) or a list of dicts, the template's `documents`.
        **extra: further template variables (they override special tokens of the same name).

    Returns:
        The rendered text.

    Raises:
        ValueError: no template, malformed or empty messages (a wrong type is also a TypeError), malformed tools or documents, a
            template that is not valid Jinja, its own `raise_exception`, or any other failure while
            rendering (the original exception is the ValueError's __cause__).
    """
    if not template:
        raise ValueError("This model has no chat template; use `generate` with plain text instead of `chat`.")
    if not isinstance(template, str):
        raise ValueError(f"The chat template must be a str of Jinja source. Received: a {type(template).__name__}")
    messages = _checked_messages(messages)
    _check_dicts("tools", tools, "JSON-schema dicts (transformers.utils.get_json_schema makes one from a function)")
    _check_dicts("documents", documents, "dicts")
    compiled = _compile(template)
    variables = {**(special_tokens or {}), **extra}  # apply_chat_template: kwargs overwrite special tokens
    try:
        return compiled.render(
            messages=messages, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt, **variables
        )
    except _Refusal as error:
        raise ValueError(f"The chat template refused the messages: {error}") from error
    except Exception as error:  # noqa: BLE001 - a template is code: a TypeError from `+` on None is as likely as a Jinja error
        raise ValueError(f"The chat template failed while rendering the messages: {type(error).__name__}: {error}") from error


def _checked_messages(messages):
    """A copy of `messages` without None values (as `apply_chat_template` passes them), refused by
    index and field when a message is not a dict or its role not a str. Content is the template's to
    read, as in transformers: a str, a list of content parts, or any value it renders (a number)."""
    if not isinstance(messages, (list, tuple)):
        raise ArgumentTypeError(f"`messages` must be a list of {{'role': ..., 'content': ...}} dicts. Received: messages of type {type(messages).__name__}")
    if not messages:
        # transformers: "Cannot apply chat template to an empty conversation"
        raise ValueError("`messages` is empty: a chat needs at least one message. Received: messages=[]")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ArgumentTypeError(f"`messages[{i}]` must be a {{'role': ..., 'content': ...}} dict. Received: {message!r}")
        if not isinstance(message.get("role"), str):
            raise ArgumentTypeError(f"`messages[{i}]['role']` must be a str. Received: role={message.get('role')!r}")
        # An assistant turn with tool calls has content None (OpenAI's format): transformers drops
        # such keys, because templates test whether a key is defined rather than whether it is None.
        checked.append({key: value for key, value in message.items() if value is not None})
    return checked


def _check_dicts(name, value, expected):
    if value is not None and (not isinstance(value, (list, tuple)) or not all(isinstance(v, dict) for v in value)):
        raise ValueError(f"`{name}` must be None or a list of {expected}. Received: {name}={value!r}")


class _Refusal(Exception):
    """Marks the template's own `raise_exception` among the errors of a rendering."""


@functools.lru_cache(maxsize=16)
def _compile(template):
    """The compiled template; a syntax error (an unknown tag, an unclosed block) as a ValueError."""
    import jinja2

    try:
        return _environment().from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as error:
        raise ValueError(f"The chat template is not valid Jinja: {error.message} (line {error.lineno})") from error
    except Exception as error:  # noqa: BLE001 - e.g. a template that is not a str
        raise ValueError(f"The chat template could not be compiled: {type(error).__name__}: {error}") from error


@functools.lru_cache(maxsize=1)
def _environment():
    """transformers' `_cached_compile_jinja_template` environment (transformers 5.x)."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _TemplateError(_Refusal, jinja2.exceptions.TemplateError):
        pass

    class GenerationTag(Extension):
        # transformers' AssistantTracker: `{% generation %}...{% endgeneration %}` marks the
        # assistant's tokens for a training mask; rendering its body as a call block (its own
        # scope, as there) is all that matters for the text.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class TemplateDict:
        # dict() and dict.fromkeys() without the dict type itself inside the sandbox
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        # refuses underscore-prefixed attributes, which could reach CPython internals
        def __init__(*args, **kwargs):
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}.")

    def raise_exception(message):
        raise _TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers' own filter: Jinja's escapes HTML characters
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(
        raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
        dict=TemplateDict(), namespace=TemplateNamespace,
    )
    return env
