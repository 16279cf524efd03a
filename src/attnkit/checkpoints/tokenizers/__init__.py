"""Rebuilding a checkpoint's tokenizer: tokenizer.json / vocab files, the tokenizer class, added tokens."""
