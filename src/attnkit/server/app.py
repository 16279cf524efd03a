"""The server's ASGI app (FastAPI): the OpenAI API over a language model and an embedding model, and the
attention explorer at /explore.

    POST /v1/chat/completions   messages through the model's chat template (streamed with "stream": true)
    POST /v1/completions        a raw prompt
    POST /v1/embeddings         the sentence-transformers pipeline's embeddings, float or base64
    GET  /v1/models             the models served
    GET  /health                {"status": "ok"} (503 while shutting down)
    GET  /explore               the explorer's page; /explore/api/model, /explore/api/attention its API

Every error is the OpenAI error object {"error": {"message", "type", "param", "code"}}. Every model
call runs in the engine's thread (`Engine.call`): Keras models are not thread-safe.
"""

import asyncio
import base64
import types

import numpy as np
from fastapi import FastAPI
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, Response

from attnkit.explorer.contract import to_json
from attnkit.explorer.page import render_page
from attnkit.explorer.sources.checks import BadInput, check_text
from attnkit.server import completions
from attnkit.server.engine import Closed
from attnkit.server.protocol import (
    ApiError, chat_messages, completion_prompt, embedding_inputs, model_name, parse_json, sampling,
)
from attnkit.server.security import BodyTooLarge, Guard

EXPLORE_ENDPOINT = "/explore/api/attention"


def create_app(engine, *, lm=None, lm_name=None, context=None, encoder=None, encoder_name=None, explorer=None,
               host="127.0.0.1", api_key=None, max_body=1 << 20):
    """The app, wrapped in the `Guard` checks.

    Args:
        engine: the `Engine` (it runs `lm`'s generations and every model call).
        lm: a `PretrainedCausalLM` with a tokenizer, or None; lm_name its id in the API.
        context: the language model's context length in tokens.
        encoder: a `PretrainedEncoder`, or None; encoder_name its id.
        explorer: an explorer source for /explore, or None.
        host, api_key, max_body: see `Guard`.
    """
    state = types.SimpleNamespace(engine=engine, lm=lm, lm_name=lm_name, context=context, encoder=encoder,
                                  encoder_name=encoder_name, explorer=explorer, closing=False)
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state

    @app.exception_handler(ApiError)
    async def api_error(request, error):
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request, error):  # 404, 405: the API's error object, not FastAPI's {"detail"}
        body = ApiError(error.status_code, f"{error.detail}: {request.method} {request.url.path}", code=str(error.status_code)).body()
        return JSONResponse(body, status_code=error.status_code, headers=getattr(error, "headers", None))

    @app.get("/health")
    async def health():
        if state.closing:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return {"status": "ok", "busy": engine.busy()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model(name) for name in _names(state)]}

    @app.get("/v1/models/{name:path}")
    async def one_model(name: str):
        if name not in _names(state):
            raise ApiError(404, f"The model `{name}` does not exist here; this server has {_names(state)}.", "model", "model_not_found")
        return _model(name)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await _body(request)
        name = model_name(body, [state.lm_name] if lm else [])
        messages, options = chat_messages(body), sampling(body, chat=True)
        if not lm.chat_template:
            raise ApiError(400, f"The model `{name}` has no chat template: use /v1/completions", "messages", "no_chat_template")
        try:
            ids = lm.chat_ids(messages)
        except Exception as e:  # noqa: BLE001 - the template's own refusal (raise_exception, a bad role order)
            raise ApiError(400, f"The chat template refused these messages: {e}", "messages") from None
        return await completions.generate(request, state, ids, options, chat=True, name=name, prompt_field="messages")

    @app.post("/v1/completions")
    async def complete(request: Request):
        body = await _body(request)
        name = model_name(body, [state.lm_name] if lm else [])
        prompt, options = completion_prompt(body), sampling(body, chat=False)
        ids = lm.encode(prompt)
        return await completions.generate(request, state, ids, options, chat=False, name=name, prompt_field="prompt")

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        body = await _body(request)
        name = model_name(body, [state.encoder_name] if encoder else [])
        texts, fmt = embedding_inputs(body)
        lengths = await _run(engine, lambda: _token_counts(encoder, texts))
        for i, n in enumerate(lengths):
            if n > encoder.max_length:
                raise ApiError(400, f"This model's maximum input length is {encoder.max_length} tokens; `input[{i}]` has {n}.",
                               f"input[{i}]", "context_length_exceeded")
        vectors = await _run(engine, lambda: encoder.encode(texts))
        tokens = sum(lengths)
        data = [
            {"object": "embedding", "index": i,
             "embedding": base64.b64encode(np.asarray(v, "<f4").tobytes()).decode() if fmt == "base64" else v.tolist()}
            for i, v in enumerate(np.asarray(vectors, "float32"))
        ]
        return {"object": "list", "data": data, "model": name, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    if explorer is not None:
        _explorer_routes(app, engine, explorer)
    return Guard(app, host=host, api_key=api_key, max_body=max_body)


def _token_counts(encoder, texts):
    """Each text's tokens, [CLS] and [SEP] included, untruncated: the pipeline cuts a text at the model's
    maximum (with a warning on the server's stderr), the OpenAI API refuses it; cut, the client would get
    the vector of its first `max_length` tokens as the whole text's."""
    return [len(e.ids) for e in encoder.tokenizer.encode_batch(texts)]


def _names(state):
    return [name for name in (state.lm_name, state.encoder_name) if name is not None]


def _model(name):
    return {"id": name, "object": "model", "created": 0, "owned_by": "attnkit"}


async def _body(request):
    try:
        raw = await request.body()
    except BodyTooLarge as e:
        raise ApiError(413, f"{e}.", None, "body_too_large") from None
    except ClientDisconnect:
        raise ApiError(400, "The client closed the connection before sending the body.") from None
    return parse_json(raw)


async def _run(engine, function):
    """`function()` in the engine's thread; a failure is a 500 naming it, bad input (ValueError) a 400, an
    engine shutting down a 503 as the completion routes answer (it was a 500 "The model failed: Closed")."""
    try:
        future = engine.call(function)
    except Closed as e:
        raise ApiError(503, f"{e}.", None, "shutting_down", "server_error") from None
    try:
        return await asyncio.wrap_future(future)
    except (BadInput, ValueError, TypeError) as e:
        raise ApiError(400, str(e).splitlines()[0] if str(e) else type(e).__name__, "input") from None
    except Exception as e:  # noqa: BLE001 - the client gets the failure as a message
        raise ApiError(500, f"The model failed: {type(e).__name__}: {e}", None, "model_error", "server_error") from None


def _explorer_routes(app, engine, source):
    """The explorer's page and API (`attnkit.explorer.server`'s, served here at /explore)."""

    def json_response(value, status=200):
        return Response(to_json(value), status_code=status, media_type="application/json",
                        headers={"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"})

    async def attention(text):
        if not isinstance(text, str):
            return json_response({"error": 'The request must be a JSON object {"text": "..."} with a string text'}, 400)
        try:
            check_text(text)
        except BadInput as e:
            return json_response({"error": str(e)}, 400)
        try:
            return json_response(await asyncio.wrap_future(engine.call(lambda: source.attention(text))))
        except Closed as e:  # shutting down: a 503, as the API's routes answer
            return json_response({"error": f"{e}."}, 503)
        except BadInput as e:
            return json_response({"error": str(e)}, 400)
        except Exception as e:  # noqa: BLE001 - the page shows every failure as a message
            return json_response({"error": f"The model failed on this text: {type(e).__name__}: {e}"}, 500)

    @app.get("/explore")
    async def page():
        html = render_page(source.describe(), endpoint=EXPLORE_ENDPOINT)
        return HTMLResponse(html, headers={"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"})

    @app.get("/explore/api/model")
    async def describe():
        return json_response(source.describe())

    @app.get(EXPLORE_ENDPOINT)
    async def attention_get(text: str = None):
        if text is None:
            return json_response({"error": 'Give the text: GET /explore/api/attention?text=... or POST {"text": ...}'}, 400)
        return await attention(text)

    @app.post(EXPLORE_ENDPOINT)
    async def attention_post(request: Request):
        try:
            body = await _body(request)
        except ApiError as e:
            return json_response({"error": e.message}, e.status)
        return await attention(body.get("text"))
