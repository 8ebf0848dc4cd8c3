"""The null model: sgl's public deterministic model (`load_format="null"`, docs/testing.md).
It has no weights and its logits cost O(batch). Its rule: the logits that follow token t
are 1 at `(7 * t + 1) mod vocab_size` and 0 everywhere else, so greedy decoding of a prompt
yields the chain that `null_next_token` iterates from the prompt's last token, and tests
can predict every output exactly while the scheduler, the cache and the detokenizer run
for real.

With a `DeviceTime` in its directory's config (`sgl_null_device_time`) each forward also
takes the time a device's would, slept on the forward's thread (the GIL released), so the
host's work around it runs meanwhile as it does beside a GPU: latency under load, the
overlap loop and the host's share of a step can be studied and tested on a CPU. Only on
the CPU: a GPU's forward is queued, not waited for, and sleeping there would block the
launching thread instead.

`null_next_token` is the rule's one definition (the model computes its logits with it,
sgl.testing predicts outputs with it), and this module imports torch only when a model
is built, so the rule stays importable on the caller's side."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, fields
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


@dataclass(frozen=True)
class DeviceTime:
    """How long a null model's forward takes: `decode_ms` for a forward of decode rows
    (speculative verify rows included), `prefill_ms` for one with a prompt's tokens in it,
    plus `per_token_us` for each token of the forward. The defaults are the Qwen3-0.6B
    architecture's on an H200 (CUDA graphs) for one request's decode step (1.7 ms) and a
    prefill of 100-1,000 tokens (3.4-4.8 ms); attention's growth with the context is
    not modelled (a decode step of 64 requests took 2.8 ms there, 1.8 here)."""

    decode_ms: float = 1.7
    prefill_ms: float = 3.2
    per_token_us: float = 1.6

    CONFIG_KEY = "sgl_null_device_time"

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not value >= 0:  # NaN too
                raise ValueError(f"DeviceTime.{name} must be a number >= 0, got {value!r}")

    def seconds(self, is_decode: bool, tokens: int) -> float:
        return ((self.decode_ms if is_decode else self.prefill_ms) * 1e3 + self.per_token_us * tokens) * 1e-6

    def to_config(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_config(cls, value: Any) -> DeviceTime | None:
        """The config's entry (None when absent); an entry that is not one names its fields."""
        if value is None:
            return None
        names = {f.name for f in fields(cls)}
        if (not isinstance(value, dict) or not set(value) <= names
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value.values())):
            raise ValueError(f"config.json's {cls.CONFIG_KEY} must be an object of numbers with fields among "
                             f"{sorted(names)}, got {value!r}")
        return cls(**{k: float(v) for k, v in value.items()})


class NullModel:
    """The model runner's CausalLM with the rule above: one layer, one head of size 1,
    so its KV pool takes next to no memory."""

    def __init__(self, vocab_size: int, device: torch.device, device_time: DeviceTime | None = None) -> None:
        import torch

        if device_time is not None and device.type != "cpu":
            raise ValueError(f"the null model's {DeviceTime.CONFIG_KEY} models a device on the CPU; this engine "
                             f"runs on {device}: use a model directory without it, or device='cpu'")
        self.device_time = device_time
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
        if self.device_time is not None:
            time.sleep(self.device_time.seconds(fb.attn.is_decode, fb.input_ids.shape[0]))
        return self._logits[:b]
