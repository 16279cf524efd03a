"""The page in a real browser: Playwright drives the system's Chromium, headless.

These tests need Debian's `chromium` package (`apt-get install -y chromium`); without it they skip,
saying so. The page does not depend on the Keras backend, so they run on torch only. Screenshots go
to $ATTNKIT_TEST_ARTIFACTS (default: a directory under pytest's tmp path, printed in the report).
"""

import json
import os
import threading

import keras
import pytest

from explorer_chromium import CHROMIUM, CHROMIUM_ARGS

from attnkit import cli
from attnkit.explorer import open_model
from attnkit.explorer.contract import to_json
from attnkit.explorer.server import ExplorerServer
from attnkit.ops import set_max_scores_bytes

SENTENCE = "The cat sat on the mat because it was warm."
MIN_DRAWN = 0.01  # the page draws no line under this weight

if keras.backend.backend() != "torch":
    pytest.skip("the page does not depend on the backend: the browser tests run on torch only",
                allow_module_level=True)
if CHROMIUM is None:
    pytest.skip("Chromium not found: install it to run the browser tests (Debian: apt-get install -y chromium)",
                allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="install Playwright: pip install playwright")


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    directory = os.environ.get("ATTNKIT_TEST_ARTIFACTS") or str(tmp_path_factory.mktemp("browser-artifacts"))
    os.makedirs(directory, exist_ok=True)
    return directory


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.attnkit_errors = errors
    yield page
    context.close()
    assert errors == [], errors  # no script error, no refused request (CSP reports go to the console)


@pytest.fixture
def serve():
    servers = []

    def start(source, text=None):
        server = ExplorerServer(source, 0, text=text)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def page_data(page):
    return json.loads(page.eval_on_selector("#attnkit-data", "e => e.textContent"))


def drawn_lines(page):
    """Every line of the head view: (head, query, key, stroke-opacity as drawn)."""
    return page.eval_on_selector_all(
        "#head-svg line.attn",
        "ls => ls.map(l => [+l.dataset.head, +l.dataset.q, +l.dataset.k, +getComputedStyle(l).strokeOpacity,"
        " +l.getAttribute('stroke-opacity')])",
    )


def expected_lines(weights, heads, rows, keys):
    """{(head, q, k): weight} of the lines the page must draw."""
    return {
        (h, q, k): weights[h][q][k] for h in heads for q in rows for k in keys if weights[h][q][k] >= MIN_DRAWN
    }


def assert_lines_follow(page, weights, heads, rows, keys):
    lines = drawn_lines(page)
    expected = expected_lines(weights, heads, rows, keys)
    assert {(h, q, k) for h, q, k, _, _ in lines} == set(expected)
    assert len(lines) == len(expected)
    for h, q, k, computed, attribute in lines:
        assert attribute == expected[(h, q, k)]  # the JSON's number, exactly
        assert computed == pytest.approx(expected[(h, q, k)], abs=1e-6)  # and what the browser draws


def explore(page, text):
    renders = page.evaluate("() => Number(document.body.dataset.renders || 0)")
    page.fill("#text", text)
    page.click("#run")
    page.wait_for_function(f"() => Number(document.body.dataset.renders || 0) > {renders}")


def test_served_head_view_and_model_view_follow_the_json(page, serve, minilm_source, artifacts):
    server = serve(minilm_source)
    page.goto(server.url)
    assert page.text_content("#message") == "Type a sentence and press \u201cShow attention\u201d."
    explore(page, SENTENCE)
    data = page_data(page)
    assert data == json.loads(to_json(minilm_source.attention(SENTENCE)))
    kind = data["attention"][0]
    w, T, h = kind["weights"], len(kind["query_tokens"]), kind["heads"]
    assert page.eval_on_selector_all("#head-svg text[data-side=q]", "ts => ts.map(t => t.firstChild.textContent)") == [
        token for token in kind["query_tokens"]
    ]
    assert_lines_follow(page, w[0], range(h), range(T), range(T))  # every line of layer 0

    page.hover("#head-svg g.token-row[data-side=q][data-index='3']")  # "cat"
    assert_lines_follow(page, w[0], range(h), [3], range(T))
    assert page.eval_on_selector("#head-svg text[data-side=q][data-index='3']", "t => t.classList.contains('focused')")
    page.screenshot(path=os.path.join(artifacts, "served-head-view-hover.png"), full_page=True)

    page.select_option("#layer", "4")
    page.click("#no-heads")
    page.check("#heads input[data-head='7']")
    page.check("#heads input[data-head='2']")
    assert_lines_follow(page, w[4], [2, 7], range(T), range(T))
    page.hover("#head-svg g.token-row[data-side=k][data-index='1']")  # lines into "the"
    assert_lines_follow(page, w[4], [2, 7], range(T), [1])
    page.mouse.move(5, 5)
    assert_lines_follow(page, w[4], [2, 7], range(T), range(T))

    # Model view: layers x heads thumbnails; a click enlarges one, cell opacities are the weights.
    assert page.locator("#grid canvas").count() == kind["layers"] * h
    page.click("#grid canvas[data-layer='2'][data-head='5']")
    assert "layer 2, head 5" in page.text_content("#enlarged-title")
    cells = page.eval_on_selector_all(
        "#enlarged-svg rect.cell", "rs => rs.map(r => [+r.dataset.q, +r.dataset.k, +r.getAttribute('fill-opacity')])"
    )
    assert len(cells) == T * T
    assert all(opacity == w[2][5][q][k] for q, k, opacity in cells)
    page.click("#to-head-view")
    assert page.input_value("#layer") == "2"
    assert_lines_follow(page, w[2], [5], range(T), range(T))
    page.screenshot(path=os.path.join(artifacts, "served-model-view.png"), full_page=True)


def test_bad_input_is_shown_in_the_page(page, serve, tiny_bert_dir, artifacts):
    source = open_model(tiny_bert_dir)  # a fresh model: jax and tensorflow check the budget as they trace
    server = serve(source)
    page.goto(server.url)
    explore(page, "the cat sat on the mat")
    assert page.locator("#head-svg line.attn").count() > 0

    page.fill("#text", "   ")
    page.click("#run")
    assert page.text_content("#message") == "The text is empty: type a sentence to see its attention."
    assert page.get_attribute("#message", "class") == "empty"
    assert page.is_hidden("#views")

    explore(page, "the big dog ran on the mat . " * 3)
    assert page.is_visible("#notes li.note")
    assert "so it was truncated to its first 16 tokens" in page.text_content("#notes li.note")
    assert page.locator("#head-svg text[data-side=q]").count() == 16
    page.screenshot(path=os.path.join(artifacts, "truncated-note.png"), full_page=True)

    set_max_scores_bytes(16)  # the real model now refuses to materialise its scores: a server error
    try:
        page.fill("#text", "the dog ran")
        page.click("#run")
        page.wait_for_selector("#message.error")
    finally:
        set_max_scores_bytes(None)
    assert page.text_content("#message").startswith(
        "The model failed on this text: MemoryError: Explicit attention would allocate a scores tensor"
    )
    assert page.is_hidden("#views")
    page.screenshot(path=os.path.join(artifacts, "server-error.png"), full_page=True)

    server.shutdown()
    server.server_close()
    page.fill("#text", "the dog ran")
    page.click("#run")
    page.wait_for_selector("#message.error")
    assert page.text_content("#message").startswith("Cannot reach the attnkit server")
    expected = ["Failed to load resource: the server responded with a status of 500 (Internal Server Error)",
                "Failed to load resource: net::ERR_CONNECTION_REFUSED"]
    assert page.attnkit_errors == expected  # the browser's own log of the two failures, and nothing else
    page.attnkit_errors.clear()


def test_translator_steps_and_attention_kinds(page, serve, translator_source, artifacts):
    server = serve(translator_source)
    page.goto(server.url)
    explore(page, "March 3, 2021")
    data = page_data(page)
    assert data == json.loads(to_json(translator_source.attention("March 3, 2021")))
    assert page.locator("#kind option").all_text_contents() == [
        "encoder self-attention", "decoder self-attention", "cross-attention"
    ]
    steps = len(data["steps"]["labels"])
    assert steps >= 4
    page.select_option("#kind", "2")  # cross-attention
    cross = data["attention"][2]
    S = len(cross["key_tokens"])
    heads = range(cross["heads"])
    assert page.locator("#head-svg text[data-side=q]").count() == steps  # the last step shows every row
    page.eval_on_selector("#step", "s => { s.value = '3'; s.dispatchEvent(new Event('input')); }")
    assert page.locator("#head-svg text[data-side=q]").count() == 4  # steps 0..3
    assert page.text_content("#step-label").startswith(f"4/{steps}: writes ")
    assert_lines_follow(page, cross["weights"][0], heads, range(4), range(S))
    page.select_option("#layer", "1")
    page.hover("#head-svg g.token-row[data-side=q][data-index='3']")
    assert_lines_follow(page, cross["weights"][1], heads, [3], range(S))
    page.screenshot(path=os.path.join(artifacts, "translator-cross-attention.png"), full_page=True)

    page.mouse.move(5, 5)  # off the tokens: nothing focused
    page.select_option("#kind", "1")  # decoder self-attention: as many keys as decoded tokens
    decoder = data["attention"][1]
    assert page.locator("#head-svg text[data-side=q]").count() == 4
    assert page.locator("#head-svg text[data-side=k]").count() == 4
    assert page.input_value("#layer") == "1"  # the layer chosen stays
    assert_lines_follow(page, decoder["weights"][1], heads, range(4), range(4))
    page.select_option("#kind", "0")  # encoder self-attention: every character, at any step
    assert page.locator("#head-svg text[data-side=q]").count() == S
    assert "does not change while decoding" in page.text_content("#step-label")


def test_the_exported_file_works_offline(page, tiny_bert_dir, tiny_source, tmp_path, artifacts):
    out = tmp_path / "page.html"
    text = "the cat sat on the mat"
    assert cli.main(["explore", "--model", tiny_bert_dir, "--export", str(out), "--text", text]) == 0
    attempted = []

    def only_files(route):
        if route.request.url.startswith("file://"):
            route.continue_()
        else:
            attempted.append(route.request.url)
            route.abort()

    page.context.route("**/*", only_files)
    page.context.set_offline(True)
    page.goto(out.as_uri())
    page.wait_for_selector("#head-svg line.attn", state="attached")
    data = page_data(page)
    assert data == json.loads(to_json(tiny_source.attention(text)))
    assert page.text_content("#exported-text") == f"Text: {text}"
    assert page.is_hidden("#input-form")
    kind = data["attention"][0]
    T = len(kind["query_tokens"])
    page.hover("#head-svg g.token-row[data-side=q][data-index='2']")
    assert_lines_follow(page, kind["weights"][0], range(kind["heads"]), [2], range(T))
    page.mouse.move(5, 5)  # off the tokens, so the redrawn layer has nothing focused
    page.select_option("#layer", "1")
    assert_lines_follow(page, kind["weights"][1], range(kind["heads"]), range(T), range(T))
    page.screenshot(path=os.path.join(artifacts, "exported-offline.png"), full_page=True)
    assert attempted == []
    resources = page.evaluate("() => performance.getEntriesByType('resource').map(e => e.name)")
    assert resources == []


def set_step(page, step):
    page.eval_on_selector("#step", f"s => {{ s.value = '{step}'; s.dispatchEvent(new Event('input')); }}")


def test_language_model_generation_step_by_step(page, serve, llama_source, artifacts):
    server = serve(llama_source)
    page.goto(server.url)
    prompt = "The cat sat on"
    explore(page, prompt)
    data = page_data(page)
    assert data == json.loads(to_json(llama_source.attention(prompt)))
    kind, steps = data["attention"][0], data["steps"]
    w, labels, P, G = kind["weights"], steps["labels"], steps["query_rows"][0], len(steps["labels"])
    heads = range(kind["heads"])
    assert G >= 6
    assert page.locator("#head-svg text[data-side=q]").count() == P + G - 1  # the last step: every token read
    assert page.locator("#heads label").all_text_contents() == ["0 (K/V 0)", "1 (K/V 0)", "2 (K/V 1)", "3 (K/V 1)"]
    assert page.text_content("#kv-note") == "4 query heads share 2 K/V heads (grouped-query attention)"
    assert "Causal" in page.text_content("#causal-hint")

    set_step(page, 2)  # writes the third token: P + 2 tokens read, the last of them this step's query
    assert page.locator("#head-svg text[data-side=q]").count() == P + 2
    assert page.locator("#head-svg text[data-side=k]").count() == P + 2  # no later token drawn
    assert page.eval_on_selector_all("#head-svg text.current", "ts => ts.map(t => +t.dataset.index)") == [P + 1]
    assert page.text_content("#step-label").startswith(f"3/{G}: writes {json.dumps(labels[2], ensure_ascii=False)}")
    spans = page.eval_on_selector_all("#generation span", "ss => ss.map(s => [s.className, s.textContent])")
    assert spans == [["prompt", t] for t in data["tokens"]] + [["generated", labels[0]], ["generated", labels[1]],
                                                                ["current", labels[2]]]
    assert_lines_follow(page, w[0], heads, range(P + 2), range(P + 2))
    page.hover(f"#head-svg g.token-row[data-side=q][data-index='{P + 1}']")  # the new token's attention
    assert_lines_follow(page, w[0], heads, [P + 1], range(P + 2))
    page.mouse.move(5, 5)
    page.select_option("#layer", "1")
    page.click("#no-heads")
    page.check("#heads input[data-head='3']")
    assert_lines_follow(page, w[1], [3], range(P + 2), range(P + 2))

    # The enlarged head: weights on and below the diagonal, later tokens grey, never a weight.
    page.click("#grid canvas[data-layer='1'][data-head='3']")
    assert "head 3 (K/V 1)" in page.text_content("#enlarged-title")
    cells = page.eval_on_selector_all(
        "#enlarged-svg rect.cell", "rs => rs.map(r => [+r.dataset.q, +r.dataset.k, +r.getAttribute('fill-opacity')])"
    )
    assert sorted((q, k) for q, k, _ in cells) == [(q, k) for q in range(P + 2) for k in range(q + 1)]
    assert all(opacity == w[1][3][q][k] for q, k, opacity in cells)
    future = page.eval_on_selector_all("#enlarged-svg rect.future", "rs => rs.map(r => [+r.dataset.q, +r.dataset.k])")
    assert sorted(map(tuple, future)) == [(q, k) for q in range(P + 2) for k in range(q + 1, P + 2)]
    page.screenshot(path=os.path.join(artifacts, "lm-step-3.png"), full_page=True)

    # Playback: on from step 3, one token at a time, to the last step.
    renders = page.evaluate("() => Number(document.body.dataset.renders)")
    page.click("#play")
    page.wait_for_function("() => document.body.dataset.playing === 'false'", timeout=30000)
    assert page.input_value("#step") == str(G - 1)
    assert page.evaluate("() => Number(document.body.dataset.renders)") - renders == G - 3  # every step drawn
    assert page.locator("#generation span.current").text_content() == labels[-1]
    assert_lines_follow(page, w[1], [3], range(P + G - 1), range(P + G - 1))
    page.screenshot(path=os.path.join(artifacts, "lm-last-step.png"), full_page=True)


def test_the_exported_language_model_page_plays_offline(page, tiny_llama_dir, llama_source, tmp_path):
    out = tmp_path / "lm.html"
    text = "Once upon a time"
    argv = ["explore", "--model", tiny_llama_dir, "--max-new-tokens", "12", "--export", str(out), "--text", text]
    assert cli.main(argv) == 0
    attempted = []

    def only_files(route):
        if route.request.url.startswith("file://"):
            route.continue_()
        else:
            attempted.append(route.request.url)
            route.abort()

    page.context.route("**/*", only_files)
    page.context.set_offline(True)
    page.goto(out.as_uri())
    page.wait_for_selector("#head-svg line.attn", state="attached")
    data = page_data(page)
    assert data == json.loads(to_json(llama_source.attention(text)))
    kind, P = data["attention"][0], data["steps"]["query_rows"][0]
    page.click("#play")  # from the last step: playback starts over at the first
    assert page.input_value("#step") == "0"
    assert page.locator("#head-svg text[data-side=k]").count() == P  # only the prompt exists yet
    assert_lines_follow(page, kind["weights"][0], range(kind["heads"]), range(P), range(P))
    page.wait_for_function("() => document.body.dataset.playing === 'false'", timeout=30000)
    assert page.input_value("#step") == str(len(data["steps"]["labels"]) - 1)
    assert attempted == []
    assert page.evaluate("() => performance.getEntriesByType('resource').map(e => e.name)") == []


# (token, its label): every character visible as itself or a stand-in, never cut inside a character.
LABELS = [
    ("\r", "<U+000D>"),  # not U+FFFD, the label of a byte piece of an incomplete character
    ("a\x00b", "a<U+0000>b"),
    ("\x7f", "<U+007F>"),
    ("\r\n", "<U+000D>\u21b5"),
    (" \t", "\u2423\u21e5"),
    ("", "\u2205"),
    ("\u200b", "<U+200B>"),
    ("\u00a0", "<U+00A0>"),
    ("\ufeff", "<U+FEFF>"),
    ("\u202eabc", "<U+202E>abc"),  # drawn "cba" when the override was left in
    ("\u0301", "\u25cc\u0301"),
    ("e\u0301\u0301", "e\u0301\u0301"),
    ("\U0001f431" * 3, "\U0001f431" * 3),
    ("\U0001f431" * 20, None),
    ("</script><img src=x onerror=\"window.pwned=1\">", None),
    ("\U0001f469\u200d\U0001f469\u200d\U0001f467" * 9, None),
    ("x" * 300, None),
]


def test_token_labels_are_whole_visible_characters_within_the_views(page, tmp_path, artifacts):
    """A label drew a character that draws as nothing (U+200B) as nothing, "\\r" as U+FFFD, cut an emoji
    between its two UTF-16 halves, and ran 16 characters past the enlarged head's left edge; the exported
    page's text was shown with its newlines and runs of spaces as one space."""
    import numpy as np

    from attnkit.explorer.contract import Attention, make_data
    from attnkit.explorer.page import render_page

    tokens = [token for token, _ in LABELS]
    T = len(tokens)
    text = "the  cat\n\tsat"  # its spaces and lines as written, not collapsed as HTML collapses them
    data = make_data(model="m", source="s", text=text, tokens=tokens,
                     attention=[Attention("self", tokens, tokens, np.full((1, 1, T, T), 1 / T))])
    out = tmp_path / "labels.html"
    out.write_text(render_page({"model": "m", "source": "s"}, data=data), encoding="utf-8")
    page.goto(out.as_uri())
    assert page.inner_text("#exported-text") == "Text: " + text
    page.click("#grid canvas")  # the enlarged head: its row and column labels too
    for svg in ("#head-svg", "#enlarged-svg"):
        labels = page.eval_on_selector_all(svg + " text.token", """ts => ts.map(t => {
            const b = t.getBoundingClientRect(), s = t.ownerSVGElement.getBoundingClientRect();
            return [t.firstChild.textContent, t.querySelector("title").textContent,
                    b.left >= s.left && b.right <= s.right && b.top >= s.top && b.bottom <= s.bottom];
        })""")
        assert len(labels) == 2 * T
        for (label, title, inside), (token, expected) in zip(labels, LABELS + LABELS):
            assert title == token and inside, (svg, token, label)
            label.encode("utf-8")  # no lone UTF-16 half of a character
            if expected is not None:
                assert label == expected, (svg, token)
            else:
                shown = token.replace(" ", "\u2423")
                assert label.endswith("\u2026") and shown.startswith(label[:-1]), (svg, token, label)
    assert page.evaluate("() => window.pwned") is None
    page.screenshot(path=os.path.join(artifacts, "token-labels.png"), full_page=True)


def test_a_text_of_several_lines_is_explored_as_written(page, serve, tiny_source):
    """The text box was a one-line input, which drops the newlines of `--text` ("the cat\nsat" showed and
    explored again as "the catsat") and turns a pasted text's into spaces."""
    text = "the cat\nsat on\n\nthe mat"
    page.goto(serve(tiny_source, text=text).url)
    page.wait_for_function("() => Number(document.body.dataset.renders || 0) > 0")
    assert page.input_value("#text") == text
    page.click("#run")  # the text box's text, explored again
    page.wait_for_function("() => Number(document.body.dataset.renders || 0) > 1")
    assert page_data(page) == json.loads(to_json(tiny_source.attention(text)))

    page.fill("#text", "the dog")
    page.press("#text", "Shift+Enter")  # a new line
    page.type("#text", "ran")
    assert page.input_value("#text") == "the dog\nran"
    page.press("#text", "Enter")  # explores
    page.wait_for_function("() => Number(document.body.dataset.renders || 0) > 2")
    assert page_data(page)["text"] == "the dog\nran"


def test_a_token_that_reverses_text_stays_in_its_place_on_the_generation_line(page, tmp_path):
    """A generated U+202E (right-to-left override) drew every later token of the generation line right to
    left: "ef" showed after "gh". Each token's span is now its own bidirectional island."""
    import numpy as np

    from attnkit.explorer.contract import Attention, Steps, make_data
    from attnkit.explorer.page import render_page

    prompt, labels = ["ab", "cd"], ["\u202e", "ef", "gh"]
    read = prompt + labels[:-1]  # the last token generated is never read
    T = len(read)
    weights = np.tril(np.ones((T, T))) / np.arange(1, T + 1)[:, None]
    data = make_data(model="m", source="causal-lm", text="abcd", tokens=prompt,
                     attention=[Attention("self", read, read, weights[None, None], stepwise=True, causal=True)],
                     steps=Steps(labels, [2, 3, 4]), output="".join(labels))
    out = tmp_path / "bidi.html"
    out.write_text(render_page({"model": "m", "source": "causal-lm"}, data=data), encoding="utf-8")
    page.goto(out.as_uri())
    set_step(page, 2)
    spans = page.eval_on_selector_all(
        "#generation span", "ss => ss.map(s => [s.textContent, s.getBoundingClientRect().left])")
    assert [text for text, _ in spans] == prompt + labels
    lefts = [left for text, left in spans if text != "\u202e"]
    assert lefts == sorted(lefts), spans


def test_the_page_calls_blank_what_the_server_calls_blank(page, serve, tiny_source):
    """The page tested blank text with JavaScript's trim(), which drops U+FEFF where Python's strip (the
    server's test) keeps it: a text the server explores was refused in the page as empty."""
    page.goto(serve(tiny_source).url)
    explore(page, "\ufeff")
    assert page.is_visible("#views")
    assert page_data(page)["tokens"] == json.loads(to_json(tiny_source.attention("\ufeff")))["tokens"]
    for blank in ("\x1c\x85 ", "\u3000\t"):  # blank in Python, so in the page too, which never asks the server
        page.fill("#text", blank)
        page.click("#run")
        assert page.text_content("#message") == "The text is empty: type a sentence to see its attention."
        assert page.get_attribute("#message", "class") == "empty"
        assert page.is_hidden("#views")
