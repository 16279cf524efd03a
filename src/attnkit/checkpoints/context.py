"""A language model's context length: config.json's `max_position_embeddings`, or a GGUF file's
`<architecture>.context_length`. The server refuses a request whose prompt and `max_tokens` do not
fit it; a fine-tuned model's directory carries its base's (`finetune.hf_directory`)."""

import json
import os


def context_length(path):
    """The context length of the model at `path` (a directory or a GGUF file); ValueError when it has none."""
    if os.path.isfile(path):
        from gguf import GGUFReader

        fields = GGUFReader(str(path)).fields
        arch = fields["general.architecture"].contents()
        field = fields.get(f"{arch}.context_length")
        value, where = (None if field is None else field.contents()), f"{path}'s {arch}.context_length"
    else:
        file = os.path.join(path, "config.json")
        with open(file, encoding="utf-8") as f:
            value, where = json.load(f).get("max_position_embeddings"), f"{file}'s max_position_embeddings"
    if isinstance(value, bool) or not isinstance(value, int) or value < 2:
        raise ValueError(f"The model's context length is needed: {where} must be an integer >= 2. Received: {value!r}")
    return value
