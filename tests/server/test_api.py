"""The server through the official `openai` client and raw HTTP: chat, streaming, completions,
embeddings, the error objects, the guards (Host, Origin, API key, body size, queue), a client gone
mid-stream, a model error, and a bounded load test."""

import base64
import concurrent.futures
import http.client
import json
import socket
import threading
import time

import keras
import numpy as np
import pytest

openai = pytest.importorskip("openai", reason="the official client drives the server")
pytest.importorskip("fastapi", reason="the server's stack (attnkit[serve])")

from attnkit.server import build, serving_in_thread  # noqa: E402
from attnkit.server import engine as engine_module  # noqa: E402
from serve_helpers import solo  # noqa: E402

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def served(lm, encoder):
    from attnkit.explorer.sources.causal_lm import CausalLMSource

    app, engine, state = build(lm, lm_name="tiny", encoder=encoder, encoder_name="tiny-bert",
                               explorer=CausalLMSource(lm, "tiny", max_new_tokens=3), max_batch=4, max_queue=64)
    with serving_in_thread(app, engine, state) as server:
        yield server, engine


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{served[0].port}/v1", api_key="unused", max_retries=0, timeout=120)


def raw(port, method, path, body=None, headers=None):
    """(status, headers, body bytes) of one HTTP request."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def error_of(body):
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_chat_is_the_library_s_greedy_reply_with_its_usage(client, lm):
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=9, temperature=0)
    ids = lm.chat_ids(MESSAGES)
    tokens = solo(lm, ids, 9)
    assert reply.choices[0].message.content == lm.decode(tokens) and reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason == "length" and reply.object == "chat.completion" and reply.model == "tiny"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == (len(ids), 9, len(ids) + 9)


def test_a_stream_gives_the_same_text_in_pieces_then_usage_then_done(client, served, lm):
    whole = client.chat.completions.create(model="tiny", messages=MESSAGES, max_completion_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_completion_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    status, headers, body = raw(served[0].port, "POST", "/v1/completions", json.dumps(
        {"model": "tiny", "prompt": "abc", "max_tokens": 3, "stream": True, "temperature": 0}), {"Content-Type": "application/json"})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [line for line in body.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and all(json.loads(e[6:])["object"] == "text_completion" for e in events[:-1])


def test_completions_sample_reproducibly_with_their_seed(client, lm):
    options = dict(model="tiny", prompt="The sky", max_tokens=10, temperature=0.8, top_p=0.9, seed=5)
    first, second = client.completions.create(**options), client.completions.create(**options)
    want = lm.decode(solo(lm, lm.encode("The sky"), 10, temperature=0.8, top_p=0.9, seed=5))
    assert first.choices[0].text == second.choices[0].text == want
    assert client.completions.create(**{**options, "seed": 6}).choices[0].text != want


def test_a_completion_without_max_tokens_stops_at_16_tokens_and_a_chat_does_not(client, lm):
    # OpenAI's completions API defaults `max_tokens` to 16; a chat reply runs to its end or the context
    reply = client.completions.create(model="tiny", prompt="abc", temperature=0)
    want = solo(lm, lm.encode("abc"), 16)
    assert reply.choices[0].text == lm.decode(want) and reply.usage.completion_tokens == len(want)
    assert len(want) < 16 or reply.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0)
    assert chat.usage.completion_tokens > 16 or chat.choices[0].finish_reason == "stop"


def test_a_stop_string_ends_the_text_before_it(client, lm):
    text = lm.decode(solo(lm, lm.encode("abc"), 16))
    stop = text[5:7]
    assert len(stop) == 2
    reply = client.completions.create(model="tiny", prompt="abc", max_tokens=16, temperature=0, stop=[stop, "\x00never"])
    assert reply.choices[0].text == text[: text.index(stop)] and reply.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="tiny", prompt="abc", max_tokens=16, temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text[: text.index(stop)]


def test_embeddings_are_the_pipeline_s_in_float_and_base64(client, encoder):
    texts = ["hello world", "a b c"]
    want = encoder.encode(texts)
    floats = client.embeddings.create(model="tiny-bert", input=texts, encoding_format="float")
    np.testing.assert_allclose([d.embedding for d in floats.data], want, rtol=0, atol=1e-6)
    default = client.embeddings.create(model="tiny-bert", input=texts)  # the client asks for base64 and decodes it
    np.testing.assert_array_equal(np.asarray([d.embedding for d in default.data], "float32"), want)
    assert floats.usage.prompt_tokens == int(encoder.tokenize(texts)[1].sum())



def test_an_embedding_input_over_the_model_s_length_is_400_not_truncated(client, encoder):
    # The OpenAI API refuses it; cut silently, the vector would be the first max_length tokens' only.
    long = "hi " * (encoder.max_length + 5)
    with pytest.raises(openai.BadRequestError) as raised:
        client.embeddings.create(model="tiny-bert", input=["fine", long])
    body = raised.value.body
    assert body["param"] == "input[1]" and body["code"] == "context_length_exceeded"
    assert str(encoder.max_length) in body["message"]
    fits = client.embeddings.create(model="tiny-bert", input="hi " * (encoder.max_length - 2), encoding_format="float")
    assert fits.usage.prompt_tokens == encoder.max_length

def test_models_and_health(client, served):
    assert [m.id for m in client.models.list().data] == ["tiny", "tiny-bert"]
    status, _, body = raw(served[0].port, "GET", "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"



def test_a_message_s_name_reaches_the_chat_template(lm):
    template = "{% for m in messages %}<{{ m.role }}{% if m.name %} {{ m.name }}{% endif %}>{{ m.content }}\n{% endfor %}<assistant>"
    saved, lm.chat_template = lm.chat_template, template
    try:
        app, engine, state = build(lm, lm_name="tiny", context=2048)
        with serving_in_thread(app, engine, state) as server:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0)
            named = [{"role": "user", "content": "Hello", "name": "Bob"}]
            reply = client.chat.completions.create(model="tiny", messages=named, max_tokens=1, temperature=0)
            assert reply.usage.prompt_tokens == len(lm.encode("<user Bob>Hello\n<assistant>", add_special_tokens=False))
            with pytest.raises(openai.BadRequestError) as raised:
                client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi", "name": 3}])
            assert raised.value.body["param"] == "messages[0].name"
    finally:
        lm.chat_template = saved

@pytest.mark.parametrize("options, param", [
    (dict(model="tiny", messages=[]), "messages"),
    (dict(model="tiny", messages=[{"role": "user", "content": 3}]), "messages[0].content"),
    (dict(model="tiny", messages=[{"role": "wizard", "content": "hi"}]), "messages[0].role"),
    (dict(model="tiny", messages=MESSAGES, temperature="hot"), "temperature"),
    (dict(model="tiny", messages=MESSAGES, max_tokens=0), "max_tokens"),
    (dict(model="tiny", messages=MESSAGES, n=2), "n"),
    (dict(model="tiny", messages=MESSAGES, logprobs=True), "logprobs"),
    (dict(model="tiny", messages=[{"role": "user", "content": "x" * 2100}]), "messages"),
    (dict(model="tiny", messages=MESSAGES, max_tokens=2040), "max_tokens"),
])
def test_bad_requests_are_400_naming_the_field(client, options, param):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(**options)
    assert raised.value.status_code == 400 and raised.value.body["param"] == param
    assert raised.value.body["type"] == "invalid_request_error" and raised.value.body["message"]


def test_an_unknown_model_is_404_on_every_route(client):
    # OpenAI's API answers an unknown model with 404 `model_not_found`, which its client raises as
    # NotFoundError (a 400 made clients report a malformed request)
    calls = [
        lambda: client.chat.completions.create(model="gpt-4", messages=MESSAGES, max_tokens=2),
        lambda: client.completions.create(model="gpt-4", prompt="Hello", max_tokens=2),
        lambda: client.embeddings.create(model="gpt-4", input="Hello"),
        lambda: client.models.retrieve("gpt-4"),
    ]
    for call in calls:
        with pytest.raises(openai.NotFoundError) as raised:
            call()
        assert raised.value.status_code == 404 and raised.value.body["code"] == "model_not_found"
        assert raised.value.body["param"] == "model" and "tiny" in raised.value.body["message"]


@pytest.mark.parametrize("options, param", [
    (dict(logprobs=0), "logprobs"),  # the completions API's 0: the sampled tokens' own logprobs, not "none"
    (dict(best_of=True), "best_of"),  # a boolean, not the integer 1
    (dict(echo=0), "echo"),
])
def test_a_completion_field_equal_to_its_default_only_in_python_is_refused(client, options, param):
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model="tiny", prompt="Hello", max_tokens=2, **options)
    assert raised.value.body["param"] == param and repr(options[param]) in raised.value.body["message"]


def test_fields_at_their_default_are_accepted(client):
    client.completions.create(model="tiny", prompt="Hello", max_tokens=2, logprobs=None, echo=False, best_of=1,
                              frequency_penalty=0.0, presence_penalty=0)
    client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, logprobs=False, top_logprobs=0,
                                   response_format={"type": "text"}, tool_choice="none")

def test_invalid_json_and_a_body_over_the_limit(served):
    port = served[0].port
    status, _, body = raw(port, "POST", "/v1/chat/completions", b'{"model": "tiny",', {"Content-Type": "application/json"})
    assert status == 400 and error_of(body)["code"] == "invalid_json"
    status, _, body = raw(port, "POST", "/v1/completions", b"x" * ((1 << 20) + 1))
    assert status == 413 and error_of(body)["code"] == "body_too_large"

    def chunks():  # no Content-Length: counted as it comes
        for _ in range(20):
            yield b"y" * 65536

    status, _, body = raw(port, "POST", "/v1/completions", chunks())  # http.client sends it chunked
    assert status == 413
    status, _, body = raw(port, "GET", "/v1/nothing")
    assert status == 404 and error_of(body)["code"] == "404"


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", '{"model": "tiny", "prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "\\udc00"}]}', "messages"),
    ("/v1/embeddings", '{"model": "tiny-bert", "input": ["ok", "\\ud83d"]}', "input"),
])
def test_a_lone_surrogate_escape_is_400_naming_the_field(served, path, body, param):
    # JSON's \ud800 without its pair decodes to no text: the tokenizer's TypeError was a bare 500
    status, _, answer = raw(served[0].port, "POST", path, body=body.encode(), headers={"Content-Type": "application/json"})
    assert status == 400 and error_of(answer)["param"] == param and "surrogate" in error_of(answer)["message"]


def test_foreign_hosts_and_origins_are_refused_and_no_cors_is_granted(served):
    port = served[0].port
    status, _, body = raw(port, "GET", "/v1/models", headers={"Host": f"evil.example:{port}"})
    assert status == 403 and error_of(body)["code"] == "host_refused"
    status, _, body = raw(port, "GET", "/v1/models", headers={"Origin": "http://evil.example"})
    assert status == 403 and error_of(body)["code"] == "origin_refused"
    for host in (f"LOCALHOST:{port}", f"LocalHost:{port}"):  # a host name is case-insensitive (RFC 3986)
        status, _, body = raw(port, "GET", "/v1/models", headers={"Host": host, "Origin": f"http://{host}"})
        assert status == 200, body
    status, headers, _ = raw(port, "GET", "/v1/models", headers={"Origin": f"http://localhost:{port}", "Host": f"localhost:{port}"})
    assert status == 200 and not any(k.lower().startswith("access-control") for k in headers)
    status, headers, _ = raw(port, "OPTIONS", "/v1/chat/completions", headers={"Access-Control-Request-Method": "POST"})
    assert status == 405 and not any(k.lower().startswith("access-control") for k in headers)


def test_an_api_key_is_required_when_set(lm):
    app, engine, state = build(lm, lm_name="tiny", context=2048, api_key="s3cret")
    with serving_in_thread(app, engine, state) as server:
        url = f"http://127.0.0.1:{server.port}/v1"
        for key in ("wrong", "s3cret0", "s3cre"):
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=url, api_key=key, max_retries=0).models.list()
        assert raw(server.port, "GET", "/v1/models")[0] == 401
        assert raw(server.port, "GET", "/health")[0] == 200
        assert openai.OpenAI(base_url=url, api_key="s3cret", max_retries=0).models.list().data[0].id == "tiny"



def test_with_an_api_key_a_wildcard_bind_answers_the_machine_s_other_names(lm):
    # `--host 0.0.0.0 --api-key K`: clients elsewhere name the machine by its address or DNS name, which
    # the server cannot list; a DNS-rebinding page cannot send the key, so the key guards instead.
    app, engine, state = build(lm, lm_name="tiny", context=2048, host="0.0.0.0", api_key="s3cret")
    with serving_in_thread(app, engine, state) as server:
        port = server.port
        for host in (f"192.0.2.7:{port}", f"gpu-box.lan:{port}"):
            status, _, body = raw(port, "GET", "/v1/models", headers={"Host": host, "Authorization": "Bearer s3cret"})
            assert status == 200 and json.loads(body)["data"][0]["id"] == "tiny"
            assert raw(port, "GET", "/v1/models", headers={"Host": host})[0] == 401
        status, _, body = raw(port, "GET", "/v1/models", headers={"Origin": "http://evil.example", "Authorization": "Bearer s3cret"})
        assert status == 403 and error_of(body)["code"] == "origin_refused"


def test_while_shutting_down_every_model_route_is_503(lm, encoder):
    from attnkit.explorer.sources.causal_lm import CausalLMSource

    app, engine, state = build(lm, lm_name="tiny", context=2048, encoder=encoder, encoder_name="tiny-bert",
                               explorer=CausalLMSource(lm, "tiny", max_new_tokens=3))
    with serving_in_thread(app, engine, state) as server:
        with engine.condition:
            engine.closing = True  # as the stop signal leaves it while requests drain
        url = f"http://127.0.0.1:{server.port}/v1"
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        for call in (lambda: client.embeddings.create(model="tiny-bert", input="hi"),
                     lambda: client.completions.create(model="tiny", prompt="hi", max_tokens=2)):
            with pytest.raises(openai.APIStatusError) as raised:
                call()
            assert raised.value.status_code == 503 and raised.value.body["code"] == "shutting_down"
        status, _, body = raw(server.port, "GET", "/explore/api/attention?text=hi")  # the explorer's page too
        assert status == 503 and "shutting down" in json.loads(body)["error"]
        with engine.condition:
            engine.closing = False

def test_a_full_queue_is_429_with_retry_after(lm):
    app, engine, state = build(lm, lm_name="tiny", context=2048, max_batch=1, max_queue=1)
    release = threading.Event()
    with serving_in_thread(app, engine, state) as server:
        engine.call(release.wait)  # the engine's thread waits: the first request waits in the queue
        body = json.dumps({"model": "tiny", "prompt": "a", "max_tokens": 2, "temperature": 0})
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(raw, server.port, "POST", "/v1/completions", body)
            while engine.busy() == 0:
                time.sleep(0.01)
            status, headers, answer = raw(server.port, "POST", "/v1/completions", body)
            assert status == 429 and headers["retry-after"] == "1" and error_of(answer)["type"] == "rate_limit_error"
            release.set()
            assert waiting.result(60)[0] == 200


def test_a_client_gone_mid_stream_stops_its_generation(served):
    port, engine = served[0].port, served[1]
    steps = engine.steps
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    connection.request("POST", "/v1/completions", body=json.dumps(
        {"model": "tiny", "prompt": "go", "max_tokens": 2000, "temperature": 0, "stream": True}))
    response = connection.getresponse()
    assert response.status == 200 and response.read1(4096).startswith(b"data: ")
    connection.sock.close()  # the client goes away
    connection.close()
    deadline = time.monotonic() + 30
    while engine.busy() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.busy() == 0 and engine.steps - steps < 1000  # stopped long before its 2000 tokens


def test_a_client_gone_before_a_whole_answer_stops_its_generation(served):
    """Not streamed: the handler has nothing to write until the end, so it watches the connection."""
    port, engine = served[0].port, served[1]
    steps = engine.steps
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    connection.request("POST", "/v1/completions", body=json.dumps(
        {"model": "tiny", "prompt": "go", "max_tokens": 2000, "temperature": 0}))
    while engine.busy() == 0:
        time.sleep(0.01)
    connection.sock.shutdown(socket.SHUT_RDWR)  # the client goes away without reading
    connection.close()
    deadline = time.monotonic() + 30
    while engine.busy() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.busy() == 0 and engine.steps - steps < 1000  # stopped long before its 2000 tokens


def test_a_model_error_fails_that_request_only(client, lm, monkeypatch):
    real, poison = engine_module.call_model, lm.encode("#")[0]
    fine = solo(lm, lm.encode("fine"), 3)
    assert poison not in fine + lm.encode("fine")

    def failing(model, ids, **options):
        if poison in np.asarray(ids):  # only the poisoned prompt has it
            raise RuntimeError("injected fault")
        return real(model, ids, **options)

    monkeypatch.setattr(engine_module, "call_model", failing)
    with pytest.raises(openai.InternalServerError, match="injected fault"):
        client.completions.create(model="tiny", prompt="# poison", max_tokens=3, temperature=0)
    with pytest.raises(openai.APIError, match="injected fault"):
        list(client.completions.create(model="tiny", prompt="# poison", max_tokens=3, temperature=0, stream=True))
    assert client.completions.create(model="tiny", prompt="fine", max_tokens=3, temperature=0).choices[0].text == \
        lm.decode(fine)


def test_the_explorer_is_served_at_explore(served, lm):
    from attnkit.explorer.contract import to_json
    from attnkit.explorer.sources.causal_lm import CausalLMSource

    port = served[0].port
    status, headers, page = raw(port, "GET", "/explore")
    assert status == 200 and headers["content-type"].startswith("text/html") and b"/explore/api/attention" in page
    status, _, body = raw(port, "POST", "/explore/api/attention", json.dumps({"text": "hi there"}))
    assert status == 200 and body == to_json(CausalLMSource(lm, "tiny", max_new_tokens=3).attention("hi there")).encode()
    status, _, body = raw(port, "POST", "/explore/api/attention", json.dumps({"text": "  "}))
    assert status == 400 and "empty" in json.loads(body)["error"]


def test_load_32_clients_200_requests_each_its_solo_reply(served, lm):
    """Bounded load on loopback: every reply equals the library's solo output; none fails. On jax and
    tensorflow 8 clients send 40 requests: their solo references cost a compiled program per shape."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{served[0].port}/v1", api_key="-", max_retries=0, timeout=300)
    total, clients = (200, 32) if keras.backend.backend() == "torch" else (40, 8)
    # Four prompt lengths (jax and tensorflow compile per shape), all prompts different.
    prompts = [f"{i:03d}" + "abcdefghijklmnopqrstuvwxyz"[: 4 * (i % 4)] for i in range(total)]
    lengths = [2 + i % 5 for i in range(total)]
    want = [lm.decode(solo(lm, lm.encode(p), n)) for p, n in zip(prompts, lengths)]

    def one(i):
        stream = i % 2 == 0
        reply = client.completions.create(model="tiny", prompt=prompts[i], max_tokens=lengths[i], temperature=0, stream=stream)
        return "".join(c.choices[0].text for c in reply) if stream else reply.choices[0].text

    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        got = list(pool.map(one, range(total)))
    elapsed = time.monotonic() - started
    assert got == want
    cache = served[1].cache  # memory bounded: the batch's rows, and slots for at most twice the context
    assert cache.keys[0].shape[0] == 4 and cache.max_length <= 2 * 2048 + 64
    print(f"load: {total} requests from {clients} clients in {elapsed:.1f} s, {served[1].steps} engine steps so far")
