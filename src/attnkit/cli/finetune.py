"""`attnkit finetune` and `attnkit export`: the language model taught a JSON-lines file with LoRA, and
the result handed to transformers and PEFT (attnkit.finetune; docs/decisions.md items 120-124).

    attnkit finetune --data train.jsonl [--eval eval.jsonl] [--model PATH] --output-dir DIR
    attnkit chat --model DIR
    attnkit export DIR OUT
"""

import argparse
import os

import keras

from attnkit.cli import processes
from attnkit.cli.errors import CommandError, non_negative_int, positive_int, seed
from attnkit.distributed.watchdog import FIRST_STEP_SECONDS, StepWatchdog
from attnkit.finetune import export, finetune


# --lora-rank, --lora-alpha and --lora-targets when not given (None: not given, which --full refuses)
LORA_DEFAULTS = dict(lora_rank=8, lora_alpha=16.0, lora_targets="q,k,v,o,gate,up,down")


def _positive_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0, not {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, not {text!r}")
    return value


def _finetune(args):
    if args.full:
        given = [f"--{flag}" for flag in ("lora-rank", "lora-alpha", "lora-targets") if getattr(args, flag.replace("-", "_")) is not None]
        if given:
            raise CommandError(f"--full trains every weight, without LoRA; {', '.join(given)} would be ignored: leave {'it' if len(given) == 1 else 'them'} out")
    if args.processes or args.coordinator or args.process_id is not None:
        return _finetune_processes(args)
    return _report(args, finetune(**_settings(args)))


def _settings(args):
    return dict(
        train_file=args.data, output_dir=args.output_dir, eval_file=args.eval, model=args.model,
        **{name: LORA_DEFAULTS[name] if getattr(args, name) is None else getattr(args, name) for name in LORA_DEFAULTS},
        epochs=args.epochs,
        learning_rate=args.learning_rate, batch_size=args.batch_size, max_length=args.max_length, seed=args.seed,
        resume=args.resume, full=args.full, save_every=args.save_every,
    )


def _finetune_processes(args):
    """--processes N: N local workers; with --coordinator and --process-id: one worker of a run over
    several machines. Every process trains on its share of each batch (docs/decisions.md item 133)."""
    backend = keras.backend.backend()
    args.processes = args.processes or 1
    processes.check_batch_size(args.batch_size, args.processes)
    processes.check_coordinator(args)
    if args.process_id is None:  # the launcher: what every worker would refuse, refused once, before any starts
        if not args.resume and os.path.isdir(args.output_dir) and os.listdir(args.output_dir):
            raise FileExistsError(f"--output-dir {os.path.abspath(args.output_dir)} already holds files; choose an empty "
                                  f"directory, or pass --resume to continue its run")
        return processes.launch(args, args.parser, "finetune", backend)
    rank, world = args.process_id, args.processes
    engine = processes.join(args, backend)
    log = print if rank == 0 else (lambda line: None)
    log(f"engine: {engine.name}; world size {world} (processes); per-process batch {args.batch_size // world}, "
        f"global batch {args.batch_size}")
    watchdog = StepWatchdog(f"worker {rank} of {world}", args.timeout, max(FIRST_STEP_SECONDS, args.timeout))
    try:
        history = finetune(**_settings(args), engine=engine, callbacks=[watchdog], log=log)
    finally:
        engine.close()
    return _report(args, history) if rank == 0 else 0


def _report(args, history):
    last = history[-1] if history else {}
    summary = f"loss {last['loss']:.4f}" if "loss" in last else ""
    if "eval_loss" in last:
        summary += f", eval loss {last['eval_loss']:.4f}, perplexity {last['perplexity']:.3f}"
    print(f"wrote {args.output_dir} ({summary}); run it with: attnkit chat --model {args.output_dir}")
    return 0


def export_finetuned(directory, out, force=False):
    """`attnkit export DIR OUT [--force]` (the export command is cli/pretrained.py's, shared with the encoders)."""
    out = export(directory, out, force)
    adapter = os.path.join(out, "adapter")
    peft = f"; PEFT: {adapter}" if os.path.isfile(os.path.join(adapter, "adapter_config.json")) else " (a full fine-tune: no adapter)"
    print(f"wrote {out} (transformers: AutoModelForCausalLM.from_pretrained{peft})")
    return 0


def add_commands(commands):
    """Adds finetune to the `attnkit` subcommands."""
    p = commands.add_parser("finetune", help="fine-tune the language model on a JSON-lines file (LoRA)")
    p.add_argument("--data", required=True, metavar="FILE", help="training data: JSON lines of messages, prompt/completion or text")
    p.add_argument("--eval", metavar="FILE", help="evaluation data, same forms: loss and perplexity after each epoch")
    p.add_argument("--model", metavar="PATH", help="a GGUF file or a llama / mistral / qwen2 directory (default SmolLM2)")
    p.add_argument("--output-dir", required=True, metavar="DIR", help="where the merged model, the adapter and the checkpoint go")
    p.add_argument("--lora-rank", type=positive_int, help="LoRA rank r (default 8)")
    p.add_argument("--lora-alpha", type=_positive_float, help="LoRA alpha; the update is scaled by alpha / r (default 16)")
    p.add_argument("--lora-targets", help="projections given LoRA (default all: q,k,v,o,gate,up,down)")
    p.add_argument("--epochs", type=positive_int, default=1, help="passes over the data (default 1)")
    p.add_argument("--learning-rate", type=_positive_float, default=2e-4, help="peak of the cosine schedule (default 2e-4)")
    p.add_argument("--batch-size", type=positive_int, default=8, help="examples per step (default 8)")
    p.add_argument("--max-length", type=positive_int, default=512, help="longest example in tokens; longer ones are refused (default 512)")
    p.add_argument("--seed", type=seed, default=0, help="seed of the data order and LoRA's initialisation (default 0)")
    p.add_argument("--save-every", type=non_negative_int, default=0, help="checkpoint every N steps too (default: each epoch's end)")
    p.add_argument("--resume", action="store_true", help="continue the run in --output-dir from its checkpoint")
    p.add_argument("--full", action="store_true", help="train every weight instead of LoRA")
    p.add_argument("--processes", type=positive_int, help="train data-parallel in N processes (--batch-size stays the global batch)")
    p.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address; with --process-id: run one worker of a multi-machine job")
    p.add_argument("--process-id", type=non_negative_int, help="this worker's index, 0 .. N-1 (with --coordinator and --processes)")
    p.add_argument("--timeout", type=positive_int, default=60, help="seconds to wait for the other processes, and for one step (default 60)")
    p.set_defaults(run=_finetune, parser=p)
