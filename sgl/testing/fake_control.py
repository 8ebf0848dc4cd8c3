"""The control plane of a fake engine's scheduler (sgl/testing/scripted.py): pausing,
aborting every request, weight updates with no weights, the weight version, memory
release and update groups, LoRA adapters loaded and unloaded with no weights, under the
real scheduler's rules (sgl.sched.control, which this module does not import: it imports
torch), its refusals worded by sgl.core.lora_rules as the real one's are."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sgl.core import lora_rules
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
    FinishReason,
    GetWeightsByNameReq,
    InitWeightsUpdateGroupReq,
    LoadLoraAdapterReq,
    Message,
    PauseGenerationReq,
    PauseMode,
    ReleaseMemoryReq,
    ResumeMemoryReq,
    UnloadLoraAdapterReq,
    UpdateWeightsFromDistributedReq,
    WeightUpdate,
)
from sgl.core.server_args import ServerArgs

if TYPE_CHECKING:
    from sgl.testing.scripted import ScriptedScheduler


class FakeAdapters:
    """The scheduler's LoRA adapters with no weights: {name: path} of those loaded (from
    lora_paths at start), and the refusals of the real one. A load reads no file, so any
    path is taken; it is refused on an engine started without LoRA, under a name already
    loaded (from any path: unload first, as SGLang and vLLM require), and past
    max_loaded_loras. An unload is refused for a name not loaded and while live requests
    use the adapter. A request naming an adapter not loaded is refused (a 400)."""

    def __init__(self, args: ServerArgs) -> None:
        self.enabled = args.lora_enabled
        self.max_loaded = args.max_loaded_loras
        self.loaded: dict[str, str] = args.lora_adapters if self.enabled else {}

    def refusal(self, name: str | None) -> str | None:
        """Why a request naming the adapter `name` cannot run, or None when it can."""
        if name is None:
            return None
        if not self.enabled:
            return lora_rules.disabled("lora_path")
        return None if name in self.loaded else lora_rules.not_loaded("lora_path", name, self.loaded)

    def load(self, name: str, path: str) -> ControlReqOutput:
        if not self.enabled:
            raise ValueError(lora_rules.disabled("lora_name"))
        if name in self.loaded:
            raise ValueError(lora_rules.name_in_use(name, self.loaded[name]))
        if len(self.loaded) >= self.max_loaded:
            raise ValueError(lora_rules.too_many(self.max_loaded))
        self.loaded[name] = path
        return self._reply(f"a fake engine loads no weights: LoRA adapter {name!r} is loaded")

    def unload(self, name: str, users: int) -> ControlReqOutput:
        """Unload `name`, which `users` live requests name."""
        if not self.enabled:
            raise ValueError(lora_rules.disabled("lora_name"))
        if name not in self.loaded:
            raise ValueError(lora_rules.not_loaded("lora_name", name, self.loaded))
        if users:
            raise ValueError(lora_rules.in_use_by_requests(name, users))
        del self.loaded[name]
        return self._reply(f"LoRA adapter {name!r} is unloaded")

    def _reply(self, message: str) -> ControlReqOutput:
        return ControlReqOutput(success=True, message=message, data={"loaded_adapters": dict(self.loaded)})


class FakeControlPlane:
    """The scheduler's control plane (sgl.sched.control) with no weights and no device:
    the pause state, the weight updates waiting for the running requests, the weight
    version, the memory released and the update groups joined, under the real one's
    rules. An update loads nothing: it flushes the prefix memory (with flush_cache) and
    sets the version. It acts on requests only through the scheduler's methods."""

    def __init__(self, scheduler: ScriptedScheduler) -> None:
        self.scheduler = scheduler
        self.paused: PauseMode | None = None
        self.refuse_new = False
        self.waiting_updates: list[WeightUpdate] = []  # until no request holds KV, or paused
        self.updates = 0
        self.weight_version = "default"
        self.released: set[str] = set()
        self.groups: set[str] = set()
        self.adapters = FakeAdapters(scheduler.args)

    @property
    def frozen(self) -> bool:
        """Nothing may be scheduled: paused, or memory released."""
        return self.paused is not None or bool(self.released)

    @property
    def admits(self) -> bool:
        """Waiting requests may be admitted (an update waiting for the running ones holds them back)."""
        return not self.frozen and not self.waiting_updates

    def refusal(self) -> FinishReason | None:
        """The finish reason of a request arriving now, if it is refused."""
        if self.refuse_new and self.frozen:
            return {"type": "abort", "status_code": 503, "message": PAUSED_REFUSAL}
        return None

    def handle(self, msg: Message) -> ControlReqOutput | None:
        """Answer a control-plane request; None for a weight update that waits for the
        running requests (its answer comes from `step`)."""
        try:
            if isinstance(msg, WeightUpdate):
                return self._update(msg)
            return self._call(msg)
        except ValueError as e:  # refused: the engine is as it was
            return ControlReqOutput(success=False, message=str(e))

    def _call(self, msg: Message) -> ControlReqOutput:
        s = self.scheduler
        if isinstance(msg, PauseGenerationReq):
            if msg.mode == "abort":
                s.abort_all(PAUSED_ABORT)
            elif msg.mode == "retract":
                s.retract_all()
            self.paused, self.refuse_new = msg.mode, msg.refuse_new
            return ControlReqOutput(success=True, message=f"generation paused ({msg.mode})",
                                    data={"num_paused_requests": len(s.live)})
        if isinstance(msg, ContinueGenerationReq):
            self.paused, self.refuse_new = None, False
            return ControlReqOutput(success=True, message="generation continued")
        if isinstance(msg, AbortAllReq):
            return ControlReqOutput(success=True, data={"aborted": s.abort_all(ABORTED_ALL)})
        if isinstance(msg, InitWeightsUpdateGroupReq):
            if msg.group_name in self.groups:
                raise ValueError(f"group_name={msg.group_name!r}: this engine is in that group already")
            self.groups.add(msg.group_name)
            return ControlReqOutput(success=True, message=f"joined weight update group {msg.group_name!r}")
        if isinstance(msg, DestroyWeightsUpdateGroupReq):
            self._check_group(msg.group_name, "")
            self.groups.remove(msg.group_name)
            return ControlReqOutput(success=True, message=f"left weight update group {msg.group_name!r}")
        if isinstance(msg, GetWeightsByNameReq):
            self._check_weights_present()
            raise ValueError(f"name={msg.name!r}: a fake engine has no weights to read")
        if isinstance(msg, ReleaseMemoryReq):
            return self._release(set[str](msg.tags or MEMORY_TAGS))
        if isinstance(msg, ResumeMemoryReq):
            self.released -= self._tags(set[str](msg.tags or MEMORY_TAGS), released=True)
            return ControlReqOutput(success=True, data={"seconds": 0.0})
        if isinstance(msg, LoadLoraAdapterReq):
            return self.adapters.load(msg.lora_name, msg.lora_path)
        if isinstance(msg, UnloadLoraAdapterReq):
            out = self.adapters.unload(msg.lora_name, sum(r.msg.lora_path == msg.lora_name for r in s.live.values()))
            s.memory.drop(msg.lora_name)
            return out
        raise ValueError(f"{type(msg).__name__} is not a control-plane call")

    def _check_group(self, name: str, hint: str) -> None:
        if name not in self.groups:
            raise ValueError(f"group_name={name!r}: no such weight update group "
                             f"(joined: {sorted(self.groups) or 'none'}){hint}")

    def _tags(self, tags: set[str], released: bool) -> set[str]:
        """`tags`, if each is released (`released`) or not, as the model runner checks them."""
        wrong = [t for t in MEMORY_TAGS if t in tags and (t in self.released) != released]
        if wrong:
            raise ValueError(f"memory tag {', '.join(map(repr, wrong))} is "
                             + ("not released" if released else "released already"))
        return tags

    def _release(self, tags: set[str]) -> ControlReqOutput:
        s = self.scheduler
        if "kv_cache" in tags and s.running:
            raise ValueError(f"{len(s.running)} requests hold KV: pause_generation(mode='abort' or 'retract') "
                             "before releasing the KV cache")
        self._tags(tags, released=False)
        if "kv_cache" in tags:
            s.memory.flush()  # the pool's content is lost
        self.released |= tags
        return ControlReqOutput(success=True, data={"seconds": 0.0})

    def _check_weights_present(self) -> None:
        if "weights" in self.released:
            raise ValueError("the weights are released: resume_memory_occupation(['weights']) before updating them")

    # ---- weight updates ----------------------------------------------------------------

    def _update(self, msg: WeightUpdate) -> ControlReqOutput | None:
        self._check_weights_present()
        if msg.abort_all_requests:
            self.scheduler.abort_all(UPDATE_ABORT)
        if self.paused is None and self.scheduler.running:
            self.waiting_updates.append(msg)  # the running requests finish first; admission waits
            return None
        return self._apply(msg)

    def step(self) -> list[ControlReqOutput]:
        """The updates that waited, run once no request holds KV (or the engine paused)."""
        if not self.waiting_updates or (self.paused is None and self.scheduler.running):
            return []
        todo, self.waiting_updates = self.waiting_updates, []
        out = []
        for msg in todo:
            try:
                got = self._apply(msg)
            except ValueError as e:  # refused: the engine is as it was
                got = ControlReqOutput(success=False, message=str(e))
            got.origin, got.req_id = msg.origin, msg.req_id
            out.append(got)
        return out

    def _apply(self, msg: WeightUpdate) -> ControlReqOutput:
        self._check_weights_present()
        if isinstance(msg, UpdateWeightsFromDistributedReq):
            self._check_group(msg.group_name, "; init_weights_update_group first")
        s = self.scheduler
        paused = len(s.live)
        if msg.flush_cache:
            s.retract_all()  # their KV was made by the old weights: recomputed on re-admission
            s.memory.flush()
        s.flush()  # what the old weights made goes out under their version
        self.updates += 1
        self.weight_version = msg.weight_version if msg.weight_version is not None else str(self.updates)
        return ControlReqOutput(success=True, message=f"a fake engine has no weights to load: weight_version is now "
                                                      f"{self.weight_version!r}",
                                data={"weight_version": self.weight_version, "num_paused_requests": paused})

    def info(self) -> dict[str, Any]:
        return {"weight_version": self.weight_version, "paused": self.paused,
                "memory_released": sorted(self.released), "weight_updates_waiting": len(self.waiting_updates),
                "weight_update_s": 0.0, "last_weight_update_s": 0.0, "lora_adapters": dict(self.adapters.loaded)}
