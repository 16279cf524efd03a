"""What the benchmarks compare against and how a row looks: the backend, a table row, and the demo
model's architecture in plain PyTorch (`workloads.py` and `demo_speed.py` both use them)."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import attnkit  # noqa: E402,F401  (chooses the Keras backend before keras is imported)
import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

BACKEND = keras.backend.backend()


def row(workload, dtype, attnkit_s, anchor, anchor_s, gflop, note="", goal=None, peak_goal=None):
    """A table row; `goal`: the least anchor/attnkit ratio the issues ask for, `peak_goal` the least
    fraction of the dtype's peak (run.py's table says whether each is met)."""
    return dict(workload=workload, backend=BACKEND, dtype=dtype, attnkit_s=attnkit_s, anchor=anchor,
                anchor_s=anchor_s, gflop=gflop, note=note, goal=goal, peak_goal=peak_goal)


class TorchSeq2Seq(torch.nn.Module):
    """The demo model's architecture in plain PyTorch: embeddings * sqrt(D) + sinusoids, nn.Transformer
    (post-LN, relu), a linear layer to the vocabulary."""

    def __init__(self, vocab, D, h, d_ff, n, rate, max_len, pad):
        super().__init__()
        self.D, self.pad, self.rate = D, pad, rate
        self.src_emb, self.tgt_emb = torch.nn.Embedding(vocab, D), torch.nn.Embedding(vocab, D)
        pos = np.arange(max_len)[:, None] / 10000 ** (np.arange(0, D, 2) / D)
        pe = np.zeros((max_len, D), "float32")
        pe[:, 0::2], pe[:, 1::2] = np.sin(pos), np.cos(pos)
        self.register_buffer("pe", torch.from_numpy(pe))
        self.transformer = torch.nn.Transformer(D, h, n, n, d_ff, rate, batch_first=True)
        self.out = torch.nn.Linear(D, vocab)
        self._init_as_keras(D)

    @torch.no_grad()
    def _init_as_keras(self, D):
        """attnkit's (Keras's) initialisation, so that the loop trains the same model: embeddings
        uniform(-0.05, 0.05) (torch's N(0, 1), times sqrt(D), drowns the positions), every kernel
        Glorot-uniform (each of W_q, W_k, W_v on its own (D, D) block), biases zero."""
        for emb in (self.src_emb, self.tgt_emb):
            torch.nn.init.uniform_(emb.weight, -0.05, 0.05)
        for name, p in self.named_parameters():
            if name.endswith("in_proj_weight"):
                for block in p.view(3, D, D):
                    torch.nn.init.xavier_uniform_(block)
            elif p.dim() == 2 and "emb" not in name:
                torch.nn.init.xavier_uniform_(p)
            elif name.endswith("bias"):
                torch.nn.init.zeros_(p)

    def embed(self, emb, ids):
        return torch.nn.functional.dropout(emb(ids) * self.D**0.5 + self.pe[: ids.shape[1]], self.rate,
                                           self.training)

    def forward(self, src, tgt):
        causal = torch.nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        y = self.transformer(
            self.embed(self.src_emb, src), self.embed(self.tgt_emb, tgt), tgt_mask=causal, tgt_is_causal=True,
            src_key_padding_mask=src == self.pad, tgt_key_padding_mask=tgt == self.pad,
            memory_key_padding_mask=src == self.pad,
        )
        return self.out(y)
