"""`attnkit serve`: an OpenAI-compatible HTTP server with continuous batching (issue 42).

An application, as the explorer is: it imports the pipelines, the models and the explorer; only the
CLI imports it.

    app, engine, state = build(lm, lm_name="m", encoder=encoder, encoder_name="e")
    with serving_in_thread(app, engine, state) as server:   # or Server(...).serve_and_close()
        OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="-").chat.completions.create(...)
"""

from attnkit.checkpoints.context import context_length
from attnkit.server.app import create_app
from attnkit.server.engine import Engine
from attnkit.server.run import Server, serving_in_thread

__all__ = ["Engine", "Server", "build", "context_length", "create_app", "serving_in_thread"]


def build(lm=None, *, lm_name=None, context=None, encoder=None, encoder_name=None, explorer=None, max_batch=8,
          max_queue=64, host="127.0.0.1", api_key=None, max_body=1 << 20):
    """(app, engine, state): the engine running `lm` (a `PretrainedCausalLM` with a tokenizer, or None) and
    the app serving it and `encoder` (a `PretrainedEncoder`, or None). `context` defaults to the model's own
    (`context_length(lm.path)`)."""
    if lm is not None and lm.tokenizer is None:
        raise ValueError(f"The language model at {lm.path} has no tokenizer (tokenizer.json): the server reads text")
    if lm is not None and context is None:
        context = context_length(lm.path)
    engine = Engine(None if lm is None else lm.model, max_batch=max_batch, max_queue=max_queue,
                    pad_id=0 if lm is None else lm.pad_id)
    app = create_app(engine, lm=lm, lm_name=lm_name, context=context, encoder=encoder, encoder_name=encoder_name,
                     explorer=explorer, host=host, api_key=api_key, max_body=max_body)
    return app, engine, app.app.state.server
