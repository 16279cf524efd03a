"""POST /v1/chat/completions and /v1/completions: a request's tokens through the engine, answered as
one JSON object or streamed as server-sent events ending in `data: [DONE]`, as the OpenAI API does.

A client that goes away cancels its generation: sse-starlette cancels a stream's event generator when
the connection closes; a non-streaming handler checks the connection whenever no event came for
`DISCONNECT_CHECK_S`. Either way a `finally` marks the request, which the engine drops before its next
step (docs/decisions.md item 115).
"""

import asyncio
import json
import secrets
import time

from sse_starlette.sse import EventSourceResponse
from starlette.responses import JSONResponse, Response

from attnkit.server.engine import Closed, QueueFull
from attnkit.server.protocol import ApiError, bad
from attnkit.server.request import Generation

DISCONNECT_CHECK_S = 0.25


def limits(state, prompt_ids, options, prompt_field):
    """The request's max_tokens, refusing a prompt or a length over the context (400)."""
    P, context = len(prompt_ids), state.context
    if P == 0:
        raise bad(prompt_field, f"`{prompt_field}` gives no tokens.")
    if P >= context:
        raise ApiError(400, f"This model's maximum context length is {context} tokens; the {prompt_field} has {P}.",
                       prompt_field, "context_length_exceeded")
    max_tokens = options["max_tokens"] if options["max_tokens"] is not None else context - P
    if P + max_tokens > context:
        field = options["max_tokens_field"]
        raise ApiError(400, f"This model's maximum context length is {context} tokens; the {prompt_field} has {P} and "
                       f"`{field}` asks for {max_tokens} more ({P + max_tokens}).", field, "context_length_exceeded")
    return max_tokens


async def generate(request, state, prompt_ids, options, *, chat, name, prompt_field):
    """The response to a (chat) completion whose prompt is `prompt_ids`."""
    max_tokens = limits(state, prompt_ids, options, prompt_field)
    lm, defaults = state.lm, state.lm.generation_defaults
    loop, events = asyncio.get_running_loop(), asyncio.Queue()
    temperature = options["temperature"] if options["temperature"] is not None else defaults.get("temperature", 1.0)
    generation = Generation(
        prompt_ids, max_tokens, lambda event: loop.call_soon_threadsafe(events.put_nowait, event), lm.decode,
        stop_ids=lm.stop_ids, stop=options["stop"], temperature=float(temperature), top_k=defaults.get("top_k"),
        top_p=options["top_p"] if options["top_p"] is not None else defaults.get("top_p"),
        repetition_penalty=defaults.get("repetition_penalty", 1.0), seed=options["seed"], vocab_size=lm.model.vocab_size,
    )
    try:
        state.engine.submit(generation)
    except QueueFull as e:
        raise ApiError(429, f"The server is busy: {e}. Retry later.", None, "queue_full", "rate_limit_error",
                       headers={"Retry-After": "1"}) from None
    except Closed as e:
        raise ApiError(503, f"{e}.", None, "shutting_down", "server_error") from None
    head = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}", "created": int(time.time()), "model": name,
        "system_fingerprint": None,
    }
    if options["stream"]:
        return EventSourceResponse(_stream(generation, events, head, chat, options["include_usage"]), ping=15, sep="\n")
    try:
        received = await _whole_answer(request, events)
    finally:
        generation.cancelled = not generation.done  # a handler cancelled before the end: free the row
    if received is None:
        return Response(status_code=499)  # nobody reads it: the client closed the connection
    event = received[-1]
    if event.error:
        raise ApiError(500, event.error, None, "model_error", "server_error")
    text = "".join(e.piece for e in received)
    choice = {"index": 0, "finish_reason": event.finish, "logprobs": None}
    choice.update({"message": {"role": "assistant", "content": text, "refusal": None}} if chat else {"text": text})
    body = {**head, "object": "chat.completion" if chat else "text_completion", "choices": [choice], "usage": _usage(event)}
    return JSONResponse(body)


async def _whole_answer(request, events):
    """The events of one generation up to its last, or None once the client has closed its connection
    (checked every DISCONNECT_CHECK_S, whether or not tokens keep coming)."""
    received, checked = [], time.monotonic()
    getter = asyncio.ensure_future(events.get())
    try:
        while True:
            done, _ = await asyncio.wait({getter}, timeout=DISCONNECT_CHECK_S)
            if done:
                received.append(getter.result())
                if received[-1].finish or received[-1].error:
                    return received
                getter = asyncio.ensure_future(events.get())
            if time.monotonic() - checked >= DISCONNECT_CHECK_S:
                if await request.is_disconnected():
                    return None
                checked = time.monotonic()
    finally:
        getter.cancel()  # no-op once done; a pending get takes no event when cancelled


def _usage(event):
    return {"prompt_tokens": event.prompt_tokens, "completion_tokens": event.completion_tokens,
            "total_tokens": event.prompt_tokens + event.completion_tokens}


async def _stream(generation, events, head, chat, include_usage):
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(piece=None, finish=None, role=False):
        if chat:
            delta = {} if piece is None and not role else {"content": piece or ""}
            if role:
                delta["role"] = "assistant"
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": piece or "", "finish_reason": finish, "logprobs": None}
        body = {**head, "object": kind, "choices": [choice]}
        if include_usage:
            body["usage"] = None
        return json.dumps(body)

    try:
        if chat:
            yield chunk(role=True)
        while True:
            event = await events.get()
            if event.error:
                error = {"message": event.error, "type": "server_error", "param": None, "code": "model_error"}
                yield json.dumps({"error": error})
                return
            if event.piece:
                yield chunk(event.piece)
            if event.finish:
                yield chunk(finish=event.finish)
                if include_usage:
                    yield json.dumps({**head, "object": kind, "choices": [], "usage": _usage(event)})
                yield "[DONE]"
                return
    finally:
        generation.cancelled = not generation.done  # the client went away: the engine drops its row
