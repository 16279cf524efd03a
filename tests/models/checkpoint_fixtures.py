"""Random-initialised checkpoints of every encoder family, saved at test time by transformers and
sentence-transformers (nothing downloaded): non-default sizes, one activation per family, a WordPiece
tokenizer (the embedded MiniLM's) or a byte-level BPE one trained here for RoBERTa and XLM-R.

`Checkpoints(root)` builds each directory once and caches it (one per test session).
"""

import json
import os
import shutil
import zlib

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the reference libraries must never reach the network

from pretrained_fixtures import MODEL_PATH  # noqa: E402

FAMILIES = ("bert", "distilbert", "roberta", "xlm-roberta", "electra")
FORMATS = ("safetensors", "sharded", "bin")
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken", ("cls", "mean"))
MAX_POSITIONS = 40  # position rows (RoBERTa: 42, with the two below the padding id)
LONG = " ".join(f"word{i} follows the cat" for i in range(30))  # far past every limit
TEXTS = ["a", "the cat sat on the mat.", "Hello, World! Café naïve", LONG, "two dogs ran " * 9, "東京 😍 x"]
BPE_CORPUS = ["the cat sat on the mat", "a dog ran in the park", "hello world", "word follows the cat",
              "café naïve 東京", "two dogs ran and ran"] * 3


def _config(family):
    import transformers as t

    sizes = dict(num_hidden_layers=2, intermediate_size=40, max_position_embeddings=MAX_POSITIONS)
    if family == "bert":
        return t.BertConfig(vocab_size=30522, hidden_size=24, num_attention_heads=3, type_vocab_size=3,
                            hidden_act="gelu", layer_norm_eps=1e-6, **sizes)
    if family == "distilbert":
        return t.DistilBertConfig(vocab_size=30522, dim=24, n_layers=2, n_heads=2, hidden_dim=36,
                                  max_position_embeddings=MAX_POSITIONS, activation="relu")
    if family == "electra":
        return t.ElectraConfig(vocab_size=30522, embedding_size=16, hidden_size=24, num_attention_heads=2,
                               hidden_act="gelu_pytorch_tanh", **sizes)
    roberta = dict(vocab_size=300, hidden_size=24, num_attention_heads=4, type_vocab_size=1, pad_token_id=1,
                   bos_token_id=0, eos_token_id=2, num_hidden_layers=2, intermediate_size=40,
                   max_position_embeddings=MAX_POSITIONS + 2)
    if family == "roberta":
        return t.RobertaConfig(hidden_act="gelu_new", **roberta)
    return t.XLMRobertaConfig(hidden_act="silu", layer_norm_eps=1e-5, **roberta)


def _tokenizer(family):
    import transformers as t

    if family not in ("roberta", "xlm-roberta"):
        return t.AutoTokenizer.from_pretrained(MODEL_PATH, model_max_length=MAX_POSITIONS)
    from tokenizers import ByteLevelBPETokenizer, processors

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(BPE_CORPUS, vocab_size=300, min_frequency=1,
                            special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"], show_progress=False)
    bpe._tokenizer.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    return t.PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
        mask_token="<mask>", model_max_length=MAX_POSITIONS,
    )


def _randomise(model, seed):
    """Weights large enough that attention is far from uniform and every tensor matters."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            parameter.copy_(1 + 0.2 * noise if "LayerNorm.weight" in name or "layer_norm.weight" in name else 0.3 * noise)


class Checkpoints:
    """Directories under `root`, built on first use."""

    def __init__(self, root):
        self.root, self._made = str(root), {}

    def base(self, family, fmt="safetensors"):
        """A transformers base-model directory (AutoModel's save_pretrained) in weight format `fmt`."""
        key = (family, fmt)
        if key not in self._made:
            import torch
            import transformers

            directory = os.path.join(self.root, f"{family}-{fmt}")
            model = transformers.AutoModel.from_config(_config(family))
            _randomise(model, seed=FAMILIES.index(family))
            model.eval()
            if fmt == "bin":
                model.config.save_pretrained(directory)
                torch.save(model.state_dict(), os.path.join(directory, "pytorch_model.bin"))
            else:
                model.save_pretrained(directory, max_shard_size="20KB" if fmt == "sharded" else "50GB")
            _tokenizer(family).save_pretrained(directory)
            self._made[key] = directory
        return self._made[key]

    def sentence(self, family, mode, *, dense=None, normalize=False, legacy_pooling=False, max_seq_length=None):
        """A sentence-transformers directory over `base(family)`: Pooling(mode), an optional Dense
        (activation class name, e.g. "Tanh"; width 24 -> 10), an optional Normalize."""
        key = (family, mode, dense, normalize, legacy_pooling, max_seq_length)
        if key not in self._made:
            import torch
            from sentence_transformers import SentenceTransformer
            from sentence_transformers.base.modules.dense import Dense
            from sentence_transformers.base.modules.normalize import Normalize
            from sentence_transformers.base.modules.transformer import Transformer
            from sentence_transformers.sentence_transformer.modules.pooling import Pooling

            transformer = Transformer(self.base(family), max_seq_length=max_seq_length)
            width = transformer.get_embedding_dimension()
            modules = [transformer, Pooling(width, pooling_mode=mode)]
            if dense is not None:
                torch.manual_seed(zlib.crc32(repr(key).encode()))  # the same weights whatever the build order; nn.Linear's own ~1/sqrt(d_in)
                modules.append(Dense(width * (len(mode) if isinstance(mode, tuple) else 1), 10,
                                     activation_function=getattr(torch.nn, dense)()))
            if normalize:
                modules.append(Normalize())
            name = "-".join(str(part) for part in key).replace("(", "").replace(")", "").replace("'", "").replace(", ", "+")
            directory = os.path.join(self.root, "st-" + name)
            SentenceTransformer(modules=modules, device="cpu").save(directory)
            if legacy_pooling:
                _write_legacy_pooling(directory, width, mode)
            self._made[key] = directory
        return self._made[key]


def _write_legacy_pooling(directory, width, mode):
    """1_Pooling/config.json in sentence-transformers' older format: one boolean key per mode."""
    from attnkit.pipelines.sentence_pipeline import LEGACY_POOLING_KEYS

    modes = mode if isinstance(mode, tuple) else (mode,)
    config = {"word_embedding_dimension": width, **{key: m in modes for key, m in LEGACY_POOLING_KEYS.items()}}
    with open(os.path.join(directory, "1_Pooling", "config.json"), "w") as f:
        json.dump(config, f)


def reference_hidden(directory, texts):
    """transformers' last hidden states (list of (T_i, d_model)) and token ids (list of lists)."""
    import torch
    import transformers

    model = transformers.AutoModel.from_pretrained(directory).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    batch = tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
    batch.pop("token_type_ids", None) if model.config.model_type == "distilbert" else None
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state.numpy()
    mask = batch["attention_mask"].numpy().astype(bool)
    return [h[m] for h, m in zip(hidden, mask)], [ids[m].tolist() for ids, m in zip(batch["input_ids"].numpy(), mask)]


def max_difference(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def copy_checkpoint(source, destination):
    """A copy of a cached checkpoint directory, for a test to edit."""
    return shutil.copytree(source, destination)


def edit_json(file, **changes):
    """Sets fields of a JSON file (a value of None removes the field)."""
    with open(file) as f:
        data = json.load(f)
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    with open(file, "w") as f:
        json.dump(data, f)
