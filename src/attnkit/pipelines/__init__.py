"""What users load: `load_pretrained` (an encoder with its sentence-transformers pipeline, `encoder.py`),
`load_causal_lm` (a language model with its tokenizer and chat template, `causal_checkpoint.py`,
`causal_lm.py`)."""
