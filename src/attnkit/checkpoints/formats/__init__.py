"""File formats: safetensors / PyTorch weights, JSON config fields, GGUF."""
