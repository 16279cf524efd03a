"""`attnkit finetune` and `attnkit export`: the language model taught a JSON-lines file with LoRA, and
the result handed to transformers and PEFT (attnkit.finetune; docs/decisions.md items 120-124).

    attnkit finetune --data train.jsonl [--eval eval.jsonl] [--model PATH] --output-dir DIR
    attnkit chat --model DIR
    attnkit export DIR OUT
"""

import argparse

from attnkit.cli.errors import non_negative_int, positive_int, seed
from attnkit.finetune import export, finetune


def _positive_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0, not {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, not {text!r}")
    return value


def _finetune(args):
    history = finetune(
        args.data, args.output_dir, eval_file=args.eval, model=args.model, lora_rank=args.lora_rank,
        lora_alpha=args.lora_alpha, lora_targets=args.lora_targets, epochs=args.epochs, learning_rate=args.learning_rate,
        batch_size=args.batch_size, max_length=args.max_length, seed=args.seed, resume=args.resume, full=args.full,
        save_every=args.save_every,
    )
    last = history[-1] if history else {}
    summary = f"loss {last['loss']:.4f}" if "loss" in last else ""
    if "eval_loss" in last:
        summary += f", eval loss {last['eval_loss']:.4f}, perplexity {last['perplexity']:.3f}"
    print(f"wrote {args.output_dir} ({summary}); run it with: attnkit chat --model {args.output_dir}")
    return 0


def export_finetuned(directory, out):
    """`attnkit export DIR OUT` (the export command is cli/pretrained.py's, shared with the encoders)."""
    out = export(directory, out)
    print(f"wrote {out} (transformers: AutoModelForCausalLM.from_pretrained; PEFT: {out}/adapter)")
    return 0


def add_commands(commands):
    """Adds finetune to the `attnkit` subcommands."""
    p = commands.add_parser("finetune", help="fine-tune the language model on a JSON-lines file (LoRA)")
    p.add_argument("--data", required=True, metavar="FILE", help="training data: JSON lines of messages, prompt/completion or text")
    p.add_argument("--eval", metavar="FILE", help="evaluation data, same forms: loss and perplexity after each epoch")
    p.add_argument("--model", metavar="PATH", help="a GGUF file or a llama / mistral / qwen2 directory (default SmolLM2)")
    p.add_argument("--output-dir", required=True, metavar="DIR", help="where the merged model, the adapter and the checkpoint go")
    p.add_argument("--lora-rank", type=positive_int, default=8, help="LoRA rank r (default 8)")
    p.add_argument("--lora-alpha", type=_positive_float, default=16.0, help="LoRA alpha; the update is scaled by alpha / r (default 16)")
    p.add_argument("--lora-targets", default="q,k,v,o,gate,up,down", help="projections given LoRA (default all: q,k,v,o,gate,up,down)")
    p.add_argument("--epochs", type=positive_int, default=1, help="passes over the data (default 1)")
    p.add_argument("--learning-rate", type=_positive_float, default=2e-4, help="peak of the cosine schedule (default 2e-4)")
    p.add_argument("--batch-size", type=positive_int, default=8, help="examples per step (default 8)")
    p.add_argument("--max-length", type=positive_int, default=512, help="longest example in tokens; longer ones are refused (default 512)")
    p.add_argument("--seed", type=seed, default=0, help="seed of the data order and LoRA's initialisation (default 0)")
    p.add_argument("--save-every", type=non_negative_int, default=0, help="checkpoint every N steps too (default: each epoch's end)")
    p.add_argument("--resume", action="store_true", help="continue the run in --output-dir from its checkpoint")
    p.add_argument("--full", action="store_true", help="train every weight instead of LoRA")
    p.set_defaults(run=_finetune)
