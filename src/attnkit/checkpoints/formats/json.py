"""Reading the JSON files of a model directory; every problem names the file."""

import json
import os

REQUIRED = "a model directory holds config.json, weights (model.safetensors, sharded safetensors or " \
           "pytorch_model.bin), and tokenizer.json or vocab.txt"


def read_json(file, *, required=True, kind=dict):
    """The JSON object (or list, with kind=list) in `file`; None when absent and not required.

    Raises:
        FileNotFoundError: a required file is absent.
        ValueError: not JSON, or not of `kind`.
    """
    if not os.path.isfile(file):
        if required:
            raise FileNotFoundError(f"{file}: file not found; {REQUIRED}")
        return None
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(data, kind):
        raise ValueError(f"{file}: expected a JSON {'object' if kind is dict else 'list'}. Received: {type(data).__name__}")
    return data
