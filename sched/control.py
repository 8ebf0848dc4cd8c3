"""The scheduler's control plane: pausing and continuing, aborting every request,
weight updates and the weight version, releasing and resuming device memory.

`ControlPlane` owns the pause state, the updates waiting for running requests to
finish, and the weight version; it acts on the other owners only through their
methods (retraction is the DecodeManager's, the radix flush the KVCache's, weights
and memory the runner's). Every action that touches weights, KV or the running set
first drains the batch in flight (`drain`), so nothing it changes is being read.

Rules:
- Paused (any mode) or with memory released, nothing is scheduled; the loop blocks on
  its input as when idle. New requests wait in the queue, or with `refuse_new` end
  at once with a 503 reason.
- A weight update runs when no request holds KV, or at once while paused. Until then
  (not paused, requests running) admission stops and the running requests finish on
  the old weights. With `abort_all_requests` every live request is aborted first, once
  the checkpoint's config and headers (or the shared tensors' entries) passed the checks.
- The weights change before anything else does: a refused update (a mismatch) leaves
  the weights, the cache and the requests as they were. With `flush_cache` the radix
  tree is emptied afterwards and requests still holding KV (paused in place) are
  retracted, so no KV made by the old weights is read again.
- A LoRA adapter loads at once (read and checked before anything changes); unloading
  is refused while a live request uses it, and frees what the radix cache holds
  under it (sgl.sched.lora).
- Releasing the KV pool needs no request to hold KV (pause with "abort" or "retract"
  first); the weights may be released under paused requests. A weight update while
  the weights are released is refused.

It never talks to the transport: the scheduler sends the replies it returns."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from sgl.core import lora_rules as rules
from sgl.core.log import get_logger
from sgl.core.protocol import (
    ABORTED_ALL,
    MEMORY_TAGS,
    PAUSED_ABORT,
    PAUSED_REFUSAL,
    UPDATE_ABORT,
    AbortAllReq,
    ContinueGenerationReq,
    ControlReqOutput,
    DestroyWeightsUpdateGroupReq,
    GetWeightsByNameReq,
    InitWeightsUpdateGroupReq,
    LoadLoraAdapterReq,
    Message,
    PauseGenerationReq,
    PauseMode,
    ReleaseMemoryReq,
    ResumeMemoryReq,
    UnloadLoraAdapterReq,
    UpdateWeightsFromDiskReq,
    UpdateWeightsFromDistributedReq,
    UpdateWeightsFromTensorReq,
    WeightUpdate,
)
from sgl.sched.decode import DecodeManager
from sgl.sched.kv_cache import KVCache
from sgl.sched.lora import LoraManager
from sgl.sched.prefill import PrefillManager
from sgl.sched.req import Req
from sgl.sched.runner.model_runner import ModelRunner


class ControlPlane:
    def __init__(self, runner: ModelRunner, kv: KVCache, prefill: PrefillManager, decode: DecodeManager,
                 rids: dict[str, Req], drain: Callable[[], None], end: Callable[[Req, str], None],
                 lora: LoraManager | None = None) -> None:
        self.runner = runner
        self.lora = lora
        self.kv = kv
        self.prefill = prefill
        self.decode = decode
        self.rids = rids  # the scheduler's live requests
        self.drain = drain  # process the batch in flight, if any
        self.end = end  # end a live request now with an abort reason, wherever it is
        self.log = get_logger("scheduler")
        self.paused: PauseMode | None = None
        self.refuse_new = False
        self.waiting_updates: list[WeightUpdate] = []  # until no request holds KV
        self.updates = 0
        self.weight_version = "default"
        self.stats = {"weight_update_s": 0.0, "last_weight_update_s": 0.0}

    # ---- what the loop may do --------------------------------------------------------

    @property
    def frozen(self) -> bool:
        """Nothing may be scheduled: paused, or memory released."""
        return self.paused is not None or bool(self.runner.released)

    @property
    def admits(self) -> bool:
        """Waiting requests may be admitted (an update waiting for the running requests
        holds them back; a chunked prompt goes on, so that its request can finish)."""
        return not self.frozen and not self.waiting_updates

    def refusal(self) -> dict[str, Any] | None:
        """The finish reason of a request arriving now, if it is refused."""
        if self.refuse_new and self.frozen:
            return {"type": "abort", "status_code": 503, "message": PAUSED_REFUSAL}
        return None

    # ---- calls -----------------------------------------------------------------------

    def handle(self, msg: Message) -> ControlReqOutput | None:
        """Answer a control-plane request; None for a weight update that waits for the
        running requests (its answer comes from `step`)."""
        try:
            out = self._update(msg) if isinstance(msg, WeightUpdate) else self._call(msg)
        except Exception as e:  # noqa: BLE001 - a refused call: the engine is as it was
            self.log.warning("control call refused", call=type(msg).__name__, error=str(e))
            out = ControlReqOutput(success=False, message=f"{type(e).__name__}: {e}" if not isinstance(
                e, ValueError) else str(e))
        return None if out is None else self._agreed(out)

    def _agreed(self, out: ControlReqOutput) -> ControlReqOutput:
        """Under tensor parallelism every rank runs each call (the same decisions: the same
        input): rank 0 answers once all have, since the caller may free what the call read
        (a shared buffer) as soon as the answer comes, and fails if any rank failed."""
        tp = self.runner.tp
        if tp.size > 1 and not tp.all_ok(out.success) and out.success:
            return ControlReqOutput(success=False, message="another tensor-parallel rank failed the call: see its log")
        return out

    def _call(self, msg: Message) -> ControlReqOutput:
        r = self.runner
        if isinstance(msg, PauseGenerationReq):
            return self._pause(msg.mode, msg.refuse_new)
        if isinstance(msg, ContinueGenerationReq):
            self.paused, self.refuse_new = None, False
            return ControlReqOutput(success=True, message="generation continued")
        if isinstance(msg, AbortAllReq):
            n = self.abort_all(ABORTED_ALL)
            return ControlReqOutput(success=True, data={"aborted": n})
        if isinstance(msg, InitWeightsUpdateGroupReq):
            r.weights.init_group(msg)
            return ControlReqOutput(success=True, message=f"joined weight update group {msg.group_name!r}")
        if isinstance(msg, DestroyWeightsUpdateGroupReq):
            r.weights.destroy_group(msg.group_name)
            return ControlReqOutput(success=True, message=f"left weight update group {msg.group_name!r}")
        if isinstance(msg, GetWeightsByNameReq):
            self._check_weights_present()
            self.drain()  # under tensor parallelism the read gathers on the group the forward uses
            return ControlReqOutput(success=True, data={"parameter": r.weights.get(msg.name, msg.truncate_size)})
        if isinstance(msg, (LoadLoraAdapterReq, UnloadLoraAdapterReq)):
            return self._lora_call(msg)
        if isinstance(msg, ReleaseMemoryReq):
            return self._release(set[str](msg.tags or MEMORY_TAGS))
        if isinstance(msg, ResumeMemoryReq):
            tags = set[str](msg.tags or MEMORY_TAGS)
            t0 = time.perf_counter()
            r.resume_memory(tags)
            return ControlReqOutput(success=True, data={"seconds": time.perf_counter() - t0})
        raise ValueError(f"{type(msg).__name__} is not a control-plane call")

    def _lora_call(self, msg: LoadLoraAdapterReq | UnloadLoraAdapterReq) -> ControlReqOutput:
        if self.lora is None:
            raise ValueError(rules.disabled("lora_name"))
        if isinstance(msg, LoadLoraAdapterReq):
            self.lora.load(msg.lora_name, msg.lora_path)
            message = f"loaded LoRA adapter {msg.lora_name!r}"
        else:
            self.drain()  # a finished request of it may still be in the batch in flight
            self.kv.forget(self.lora.unload(msg.lora_name, self.rids.values()))
            message = f"unloaded LoRA adapter {msg.lora_name!r}"
        return ControlReqOutput(success=True, message=message,
                                data={"loaded_adapters": self.lora.info()["lora_adapters"]})

    def _pause(self, mode: PauseMode, refuse_new: bool) -> ControlReqOutput:
        self.drain()
        if mode == "abort":
            self.abort_all(PAUSED_ABORT)
        elif mode == "retract":
            self.retract_all()
        self.paused, self.refuse_new = mode, refuse_new
        return ControlReqOutput(success=True, message=f"generation paused ({mode})",
                                data={"num_paused_requests": len(self.rids)})

    def abort_all(self, message: str) -> int:
        """End every live request with an abort reason, now; how many."""
        self.drain()
        live = list(self.rids.values())
        for req in live:
            self.end(req, message)
        return len(live)

    def retract_all(self) -> int:
        """Send every KV holder back to the queue, progress kept, oldest first in it."""
        self.drain()
        holders = sorted(self.decode.holders(), key=lambda r: r.arrival, reverse=True)
        for req in holders:  # youngest first: each retraction goes to the front of the queue
            self.decode.retract(req)
        return len(holders)

    def _release(self, tags: set[str]) -> ControlReqOutput:
        if "kv_cache" in tags and (held := self.decode.holders()):
            raise ValueError(f"{len(held)} requests hold KV: pause_generation(mode='abort' or 'retract') "
                             "before releasing the KV cache")
        self.drain()
        t0 = time.perf_counter()
        if "kv_cache" in tags and "kv_cache" not in self.runner.released:
            self.kv.flush()  # the pool's content is lost: the tree must not point into it
        self.runner.release_memory(tags)
        return ControlReqOutput(success=True, data={"seconds": time.perf_counter() - t0})

    # ---- weight updates ----------------------------------------------------------------

    def _update(self, msg: WeightUpdate) -> ControlReqOutput | None:
        self._check_weights_present()
        # What can be refused before the weights are read is refused before anything is aborted
        # or waits for the running requests: a refused update leaves the engine as it was.
        if isinstance(msg, UpdateWeightsFromDiskReq):
            self.runner.weights.check_disk(msg.model_path, msg.load_format)
        elif isinstance(msg, UpdateWeightsFromTensorReq):
            self.runner.weights.check_tensors(msg.tensors)
        if msg.abort_all_requests:
            self.abort_all(UPDATE_ABORT)
        if self.paused is None and self.decode.holders():
            self.waiting_updates.append(msg)  # the running requests finish first; admission waits
            return None
        return self._apply(msg)

    def step(self) -> list[ControlReqOutput]:
        """Run the updates that waited, once no request holds KV (or the engine paused)."""
        if not self.waiting_updates or (self.paused is None and self.decode.holders()):
            return []
        todo, self.waiting_updates = self.waiting_updates, []
        out = []
        for msg in todo:
            try:
                got = self._apply(msg)
            except Exception as e:  # noqa: BLE001 - refused: the engine is as it was
                got = ControlReqOutput(success=False, message=str(e))
            got = self._agreed(got)
            got.origin, got.req_id = msg.origin, msg.req_id
            out.append(got)
        return out

    def _check_weights_present(self) -> None:
        if "weights" in self.runner.released:
            raise ValueError("the weights are released: resume_memory_occupation(['weights']) before updating them")

    def _apply(self, msg: WeightUpdate) -> ControlReqOutput:
        self._check_weights_present()
        self.drain()
        w = self.runner.weights
        t0 = time.perf_counter()
        if isinstance(msg, UpdateWeightsFromDiskReq):
            n = w.from_disk(msg.model_path, msg.load_format)
        elif isinstance(msg, UpdateWeightsFromTensorReq):
            n = w.from_tensors(msg.tensors)
        elif isinstance(msg, UpdateWeightsFromDistributedReq):
            n = w.from_distributed(msg)
        else:
            raise ValueError(f"{type(msg).__name__} is not a weight update")
        seconds = time.perf_counter() - t0
        paused = len(self.rids)
        if msg.flush_cache:
            self.retract_all()  # their KV was made by the old weights: recomputed on re-admission
            self.kv.flush()
        self.updates += 1
        self.weight_version = msg.weight_version if msg.weight_version is not None else str(self.updates)
        self.stats["weight_update_s"] += seconds
        self.stats["last_weight_update_s"] = seconds
        self.log.info("weights updated", tensors=n, seconds=round(seconds, 3), weight_version=self.weight_version)
        return ControlReqOutput(success=True, message=f"updated {n} tensors in {seconds:.3f} s",
                                data={"weight_version": self.weight_version, "num_paused_requests": paused,
                                      "tensors": n, "seconds": seconds})

    def info(self) -> dict[str, Any]:
        return {"weight_version": self.weight_version, "paused": self.paused,
                "memory_released": sorted(self.runner.released), "weight_updates_waiting": len(self.waiting_updates),
                **self.stats}
