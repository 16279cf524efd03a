"""Reading and writing checkpoints: file formats (`formats/`), tokenizers (`tokenizers/`), the encoder
families (`families/`), export, generation settings. Imports `models/` and below, never `pipelines/`."""
