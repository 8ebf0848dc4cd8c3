"""The null model: sgl's public deterministic model (`load_format="null"`, docs/testing.md).
It has no weights and its logits cost O(batch). Its rule: the logits that follow token t
are 1 at `(7 * t + 1) mod vocab_size` and 0 everywhere else, so greedy decoding of a prompt
yields the chain that `null_next_token` iterates from the prompt's last token, and tests
can predict every output exactly while the scheduler, the cache and the detokenizer run
for real.

`null_next_token` is the rule's one definition (the model computes its logits with it,
sgl.testing predicts outputs with it), and this module imports torch only when a model
is built, so the rule stays importable on the caller's side."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, overload

if TYPE_CHECKING:
    import torch

    from sgl.sched.models.forward_batch import ForwardBatch


@overload
def null_next_token(token: int, vocab_size: int) -> int: ...
@overload
def null_next_token(token: torch.Tensor, vocab_size: int) -> torch.Tensor: ...
def null_next_token(token: Any, vocab_size: int) -> Any:
    """The token the null model puts its logit on after `token` (an int, or a tensor of them)."""
    return (token * 7 + 1) % vocab_size


class NullModel:
    """The model runner's CausalLM with the rule above: one layer, one head of size 1,
    so its KV pool takes next to no memory."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        import torch

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
        self._arange = torch.arange(0, device=device)

    def __call__(self, fb: ForwardBatch) -> torch.Tensor:
        last = fb.input_ids[fb.logits_indices]
        b = last.shape[0]
        if b > self._logits.shape[0]:
            self._logits = self._logits.new_zeros((b, self.vocab_size))
            self._hot = self._hot.new_zeros(b)
            self._arange = self._hot.new_tensor(range(b))
        rows = self._arange[:b]
        self._logits[rows, self._hot[:b]] = 0.0
        self._hot[:b] = null_next_token(last, self.vocab_size)
        self._logits[rows, self._hot[:b]] = 1.0
        return self._logits[:b]
