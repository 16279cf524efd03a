"""Chat templates: a model's Jinja template rendered as transformers' `apply_chat_template` renders it.

The same sandboxed environment (trim_blocks, lstrip_blocks, loop controls), the same globals
(`raise_exception`, `strftime_now`) and `tojson` filter, and the special tokens as variables.
"""

import json
from datetime import datetime


def render_chat(template, messages, *, add_generation_prompt=True, special_tokens=None, **extra):
    """The prompt text for `messages`.

    Args:
        template: the Jinja source.
        messages: a list of {"role": ..., "content": ...} dicts.
        add_generation_prompt: end with the assistant's turn header. Default True.
        special_tokens: {"bos_token": ..., "eos_token": ..., ...} made available to the template.
        **extra: further template variables (tools, documents, ...).

    Returns:
        The rendered text.

    Raises:
        ValueError: no template, malformed messages, or the template's own `raise_exception`.
    """
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if not template:
        raise ValueError("This model has no chat template; use `generate` with plain text instead of `chat`.")
    if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise ValueError(f"`messages` must be a list of {{'role': ..., 'content': ...}} dicts. Received: messages={messages!r}")

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers' own filter: Jinja's escapes HTML characters
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, **(special_tokens or {}), **extra
        )
    except jinja2.exceptions.TemplateError as error:
        raise ValueError(f"The chat template refused the messages: {error}") from None
