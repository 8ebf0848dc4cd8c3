"""The null model: no weights, logits in no time. Its greedy next token is a fixed
function of the current token, (t * 7 + 1) mod vocab, so pipeline tests can
predict outputs exactly while measuring only the framework's overhead."""

from __future__ import annotations

import torch
from torch import nn

from sgl.sched.models.forward_batch import ForwardBatch


def null_next_token(token: int, vocab_size: int) -> int:
    return (token * 7 + 1) % vocab_size


class NullModel(nn.Module):
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.num_layers = 1
        self.num_heads = 1
        self.num_kv_heads = 1
        self.head_dim = 1
        self.device = device
        # One persistent one-hot buffer: each call clears its last hot entries and sets
        # new ones, so the "forward" costs O(batch), not an allocation of batch x vocab.
        self._logits = torch.zeros((0, vocab_size), dtype=torch.float32, device=device)
        self._hot = torch.zeros(0, dtype=torch.int64, device=device)

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        last = fb.input_ids[fb.logits_indices]
        b = last.shape[0]
        if b > self._logits.shape[0]:
            self._logits = torch.zeros((b, self.vocab_size), dtype=torch.float32, device=self.device)
            self._hot = torch.zeros(b, dtype=torch.int64, device=self.device)
        rows = torch.arange(b, device=self.device)
        self._logits[rows, self._hot[:b]] = 0.0
        self._hot[:b] = (last * 7 + 1) % self.vocab_size
        self._logits[rows, self._hot[:b]] = 1.0
        return self._logits[:b]
