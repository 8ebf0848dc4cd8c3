"""What a generate request carries besides its prompt, and the checks of its types.

`ReqOptions` holds the request-level arguments of generate() beyond the sampling
parameters; `generation_defaults` reads the model's generation_config.json;
`replace_params` copies sampling parameters with changes; `is_int`/`is_int_list`
check types; `check_request` checks a request's types, then its values through
sgl/core/request_checks.py (which the scheduler applies too). Pure functions and
data: this module holds no request state and does no I/O but the one config read."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import msgspec

from sgl.core.lora_rules import bad_name, is_name
from sgl.core.request_checks import RequestLimits, request_error
from sgl.core.sampling_params import GENERATION_CONFIG_FIELDS, SamplingParams


@dataclass(frozen=True, slots=True)
class ReqOptions:
    """Request-level arguments of generate() beyond the sampling parameters (SGLang's names)."""

    return_logprob: bool = False
    logprob_start_len: int = -1  # first prompt position with a logprob; -1: output logprobs only
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    return_text_in_logprobs: bool = False
    custom_logit_processor: str | None = None
    detokenize: bool = True
    priority: int = 0  # higher is more urgent (SGLang's); schedule_policy="priority" orders by it
    timeout: float | None = None  # seconds from the scheduler's receipt; None: the server's request_timeout
    lora_path: str | None = None  # the LoRA adapter (its name, as SGLang's field) that runs it; None: the base model


def replace_params(p: SamplingParams, **changes: Any) -> SamplingParams:
    return msgspec.structs.replace(p, **changes)


def generation_defaults(model_path: str | None) -> dict[str, Any]:
    """Sampling defaults from the model's generation_config.json (the fields SGLang takes from it)."""
    if model_path is None or not os.path.isdir(model_path):
        return {}
    try:
        with open(os.path.join(model_path, "generation_config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return {}
    return {k: cfg[k] for k in GENERATION_CONFIG_FIELDS if k in cfg and cfg[k] is not None}


def is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_int_list(x: object) -> bool:
    """A list of ints, bools excluded: msgspec checks a 2,000-id prompt in ~10 us, a
    Python loop over it in ~200 us (values are checked in sgl/core/request_checks.py)."""
    if not isinstance(x, list):
        return False
    try:
        msgspec.convert(x, list[int], strict=True)
    except msgspec.ValidationError:
        return False
    return True


def check_request(ids: list[int], params: SamplingParams, opts: ReqOptions, limits: RequestLimits) -> None:
    """Raise a ValueError naming the field for a request that cannot run: the types
    here, the values in sgl/core/request_checks.py (which the scheduler applies too)."""
    for name, toks in (("stop_token_ids", params.stop_token_ids), ("logit_bias", list(params.logit_bias)),
                       ("token_ids_logprob", opts.token_ids_logprob or [])):
        if not is_int_list(toks):
            raise ValueError(f"{name}: must be a list of ints")
    # Every field must have its declared type here: the scheduler drops a frame it cannot
    # decode, and a request dropped there would never be answered.
    for name in ("return_logprob", "return_text_in_logprobs", "detokenize"):
        if not isinstance(getattr(opts, name), bool):
            raise ValueError(f"{name}={getattr(opts, name)!r} is invalid: must be a bool")
    for name in ("logprob_start_len", "top_logprobs_num", "priority"):
        if not is_int(getattr(opts, name)):
            raise ValueError(f"{name}={getattr(opts, name)!r} is invalid: must be an int")
    if opts.lora_path is not None and not is_name(opts.lora_path):
        raise ValueError(bad_name("lora_path", opts.lora_path))
    t = opts.timeout
    if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float))):
        raise ValueError(f"timeout={t!r} is invalid: must be a number of seconds")
    error = request_error(ids, params, opts.logprob_start_len, opts.top_logprobs_num, opts.token_ids_logprob,
                          opts.custom_logit_processor, limits, opts.return_logprob, opts.priority,
                          None if t is None else float(t))
    if error is not None:
        raise ValueError(error)
