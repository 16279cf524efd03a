"""Fine-tuning the language model on a user's JSON-lines data, with LoRA, and handing the result back to
the Hugging Face ecosystem: `finetune(train_file, output_dir, ...)`, `export(directory, out)`.

An application: it imports the models and checkpoints; only `attnkit.cli` imports it.
"""

from attnkit.finetune.export import export
from attnkit.finetune.run import finetune

__all__ = ["export", "finetune"]
