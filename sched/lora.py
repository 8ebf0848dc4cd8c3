"""The scheduler's LoRA adapters: which are loaded (in host memory), and which sit in
the device's slots.

`LoraManager` owns the adapters by name, the id each load gets, and the slot table.
Rules, one place:
- Each load gets a fresh id (never reused): requests carry it, and the radix cache
  keys prefixes by it (id 0 is the base model), so a prefix cached under one adapter
  is never served to another, nor to the same name loaded again from other files.
- A request takes its adapter's slot at admission (`slot_for`); slots held by
  requests that hold KV (running, prefilling, admitted this round) are busy. An
  adapter not in a slot goes into a free one, else into the least recently used idle
  one; with every slot busy the request waits (the round goes on with others, as
  vLLM's scheduler does), so at most `slots` adapters are in a batch.
- Unloading is refused while a live request (queued or running) uses the adapter; a
  load that fails, on this tensor-parallel rank or another, leaves every rank's adapters
  as they were.

It decides nothing else about requests and touches the device only through the
runner's `load_lora`, queued in order with the forwards."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from sgl.core import lora_rules as rules
from sgl.core.log import get_logger
from sgl.core.server_args import ServerArgs
from sgl.sched.models.lora_adapter import LoraAdapter

if TYPE_CHECKING:
    from sgl.sched.req import Req
    from sgl.sched.runner.model_runner import ModelRunner

BASE = 0  # the base model's id (no adapter)
OTHER_RANK_FAILED = "another tensor-parallel rank failed to load the adapter (see its log): no rank loaded it"


class LoraManager:
    def __init__(self, runner: ModelRunner, args: ServerArgs) -> None:
        spec = runner.lora_spec
        assert spec is not None, "the runner was built without LoRA slots"
        self.runner = runner
        self.max_rank = spec.rank
        self.targets = spec.targets
        self.max_loaded = args.max_loaded_loras
        self.log = get_logger("scheduler")
        self.adapters: dict[str, LoraAdapter] = {}
        self.ids: dict[str, int] = {}  # name -> the id of its current load
        self._ids = itertools.count(BASE + 1)
        self.slot_id: list[int] = [BASE] * spec.slots  # the adapter id in each slot; BASE: empty
        self.slot_used: list[int] = [0] * spec.slots  # when each slot was last taken (LRU)
        self._tick = itertools.count(1)
        self.slot_loads = 0  # adapters copied into a slot
        for name, path in args.lora_adapters.items():
            self.load(name, path)

    # ---- loading -------------------------------------------------------------

    def load(self, name: str, path: str) -> None:
        """Read, check and keep an adapter; ValueError saying why not (nothing changes)."""
        if not rules.is_name(name):
            raise ValueError(rules.bad_name("lora_name", name))
        if name in self.adapters:
            raise ValueError(rules.name_in_use(name, self.adapters[name].path))
        if len(self.adapters) >= self.max_loaded:
            raise ValueError(rules.too_many(self.max_loaded))
        r = self.runner
        failure: Exception | None = None
        try:
            adapter = LoraAdapter.load(name, path, r.config, r.dtype, self.max_rank, self.targets,
                                       pin=r.device.type == "cuda")
        except Exception as e:  # noqa: BLE001 - raised below, once the ranks agree
            failure = e
        # Every tensor-parallel rank keeps it or none does (a read that failed on one rank only):
        # requests carry its id and take its slots alike on every rank.
        if not r.tp.all_ok(failure is None):
            raise failure or RuntimeError(OTHER_RANK_FAILED)
        self.adapters[name] = adapter
        self.ids[name] = next(self._ids)
        self.log.info("LoRA adapter loaded", lora=name, path=path, rank=adapter.rank,
                      targets=sorted(adapter.targets), mib=round(adapter.nbytes / 2**20, 1))

    def unload(self, name: str, live: Iterable[Req]) -> int:
        """Forget an adapter; returns its id (the caller drops what the cache holds under
        it). ValueError if it is not loaded or a live request uses it."""
        if name not in self.adapters:
            raise ValueError(rules.not_loaded("lora_name", name, self.adapters))
        uid = self.ids[name]
        users = sum(1 for q in live if q.lora_id == uid)
        if users:
            raise ValueError(rules.in_use_by_requests(name, users))
        del self.adapters[name], self.ids[name]
        for s, held in enumerate(self.slot_id):
            if held == uid:
                self.slot_id[s] = BASE  # its content stays until another adapter overwrites it
        self.log.info("LoRA adapter unloaded", lora=name)
        return uid

    # ---- requests ------------------------------------------------------------

    def resolve(self, req: Req) -> str | None:
        """Set a new request's adapter id from its adapter name; the error if it has none."""
        if req.lora_name is None:
            return None
        uid = self.ids.get(req.lora_name)
        if uid is None:
            return rules.not_loaded("lora_path", req.lora_name, self.adapters)
        req.lora_id = uid
        return None

    def busy(self, holders: Iterable[Req]) -> set[int]:
        """The slots the given requests (those holding KV) use."""
        return {q.lora_slot for q in holders if q.lora_slot >= 0}

    def slot_for(self, req: Req, busy: set[int]) -> bool:
        """Give an admitted request its adapter's slot (loading the adapter into a free or
        the least recently used idle slot if it is in none), and add it to `busy`. False
        when every slot is busy with other adapters: the request waits."""
        if req.lora_id == BASE:
            req.lora_slot = -1
            return True
        name = req.lora_name
        assert name is not None and self.ids.get(name) == req.lora_id, "a live request's adapter stays loaded"
        try:
            slot = self.slot_id.index(req.lora_id)
        except ValueError:
            idle = [s for s in range(len(self.slot_id)) if s not in busy]
            if not idle:
                return False
            slot = min(idle, key=lambda s: (self.slot_id[s] != BASE, self.slot_used[s]))
            self.runner.load_lora(slot, self.adapters[name])
            self.slot_id[slot] = req.lora_id
            self.slot_loads += 1
        self.slot_used[slot] = next(self._tick)
        req.lora_slot = slot
        busy.add(slot)
        return True

    def info(self) -> dict[str, Any]:
        return {"lora_adapters": {n: a.path for n, a in self.adapters.items()},
                "max_loras_per_batch": len(self.slot_id), "max_lora_rank": self.max_rank,
                "lora_slot_loads": self.slot_loads}
