"""Custom logit processors: a base class, a registry of named processors, and the
resolution of a request's processor name against the engine's allow-list.

A request names a processor (a registered name or an importable dotted path,
`pkg.mod:Class` or `pkg.mod.Class`); nothing but that name travels on the wire,
never code. Only names in `ServerArgs.custom_logit_processors` may be used.
This module imports nothing of sgl; it must not import user code except in
`resolve`, which the scheduler calls, and imports torch only inside a processor's
call: the caller's side checks names against the allow-list without torch, and
only the scheduler, which has it loaded already, calls a processor."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

# Keys the scheduler adds to each row's params (user keys never start with "__").
OUTPUT_LEN_KEY = "__output_len__"  # tokens the request generated before this one
RID_KEY = "__rid__"
BEAM_KEY = "__beam__"  # beam requests: the row's beam (0 = the best running one at the last step)
OUTPUT_IDS_KEY = "__output_ids__"  # the row's output ids so far, for processors with needs_output_ids


class CustomLogitProcessor:
    """Subclass and implement `__call__`; one instance serves every request naming it.

    `__call__(logits, params)` gets the rows [b, V] (float32) of the requests that
    named this processor, after logit_bias, penalties and the min_new_tokens mask
    and before temperature, and the list of their `custom_params` dicts (with
    `__output_len__` and `__rid__` added). It returns the new rows [b, V].

    Under beam search each beam is a row: its params also carry `__beam__`, and its
    logits are log-probabilities (Hugging Face's order: processors see log_softmax).
    A processor that sets `needs_output_ids = True` gets each row's `__output_ids__`
    (the beam's own, following it when it forks); its requests then never overlap
    their own steps (the ids must be known on the host before each step)."""

    name: ClassVar[str | None] = None
    needs_output_ids: ClassVar[bool] = False

    def __call__(self, logits: torch.Tensor, params: list[dict[str, Any]]) -> torch.Tensor:
        raise NotImplementedError


_REGISTRY: dict[str, type[CustomLogitProcessor]] = {}


def register(cls: type[CustomLogitProcessor]) -> type[CustomLogitProcessor]:
    """Class decorator: make `cls.name` a registered name (the class's module must be
    imported in the scheduler, e.g. by naming its dotted path in the allow-list)."""
    if not cls.name:
        raise ValueError(f"{cls.__name__}.name: a registered processor needs a name")
    _REGISTRY[cls.name] = cls
    return cls


@register
class ForceTokens(CustomLogitProcessor):
    """Forces `custom_params["tokens"][i]` as the i-th output token (then leaves the row alone)."""

    name = "force_tokens"

    def __call__(self, logits: torch.Tensor, params: list[dict[str, Any]]) -> torch.Tensor:
        import torch

        from sgl.core.host_copy import to_device

        rows, ids = [], []
        for i, p in enumerate(params):
            toks, k = p.get("tokens", []), p[OUTPUT_LEN_KEY]
            if k < len(toks):
                rows.append(i)
                ids.append(toks[k])
        if rows:
            if not all(isinstance(t, int) and 0 <= t < logits.shape[1] for t in ids):
                raise ValueError(f"custom_params.tokens: ids must be ints in [0, {logits.shape[1]})")
            # Built on the host, then moved: a tensor made on a GPU from a list would wait for it.
            at, forced = (to_device(torch.tensor(x), logits.device) for x in (rows, ids))
            logits[at] = float("-inf")
            logits[at, forced] = 0.0
        return logits


def check_allowed(name: str, allowed: list[str]) -> None:
    if name not in allowed:
        raise ValueError(
            f"custom_logit_processor={name!r} is not allowed: the engine allows {allowed or 'none'} "
            "(ServerArgs.custom_logit_processors)"
        )


def resolve(name: str) -> CustomLogitProcessor:
    """A registered name or a dotted path to a CustomLogitProcessor subclass -> an instance."""
    cls = _REGISTRY.get(name)
    if cls is None:
        mod_name, sep, attr = name.partition(":")
        if not sep:
            mod_name, _, attr = name.rpartition(".")
        try:
            cls = getattr(importlib.import_module(mod_name), attr) if mod_name else None
        except (ImportError, AttributeError) as e:
            raise ValueError(f"custom_logit_processor={name!r} cannot be imported: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, CustomLogitProcessor)):
        raise ValueError(f"custom_logit_processor={name!r} is not a registered name or a CustomLogitProcessor class")
    return cls()
