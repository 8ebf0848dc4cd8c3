"""The null model: no weights, logits in no time. Its greedy next token is a fixed
function of the current token, (t * 7 + 1) mod vocab, so pipeline tests can
predict outputs exactly while measuring only the framework's overhead."""

from __future__ import annotations

import torch
from torch import nn

from sgl.sched.forward_batch import ForwardBatch


def null_next_token(token: int, vocab_size: int) -> int:
    return (token * 7 + 1) % vocab_size


class NullModel(nn.Module):
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.num_layers = 1
        self.num_kv_heads = 1
        self.head_dim = 1
        self.device = device

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        last = fb.input_ids[fb.logits_indices]
        logits = torch.zeros((last.shape[0], self.vocab_size), dtype=torch.float32, device=last.device)
        return logits.scatter_(1, ((last * 7 + 1) % self.vocab_size)[:, None], 1.0)
