"""The running model's weights, after start-up: replaced from a checkpoint on disk, from
tensors another process shares (sgl.weights.share_tensors), or from a trainer's
broadcasts over a weight-update group; read back by Hugging Face name; and moved off
the device and back (memory release for RL trainers).

Every update checks every name, shape and dtype against the model before its first
copy, so one that fails leaves the old weights as they were, and copies into the
parameters' own storage (never reallocating), so CUDA graphs stay valid. It runs on
the scheduler's thread with no batch in flight; it decides nothing about requests or
the radix cache (the scheduler pauses, waits and flushes)."""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from sgl.core.protocol import InitWeightsUpdateGroupReq, SharedTensors, UpdateWeightsFromDistributedReq
from sgl.sched.models.forward_batch import CausalLM
from sgl.sched.models.fp8_checkpoint import Fp8Checkpoint
from sgl.sched.models.null import NullModel
from sgl.sched.models.parallel import TPGroup
from sgl.transports.tensors import DTYPES, UpdateGroup, init_update_group, open_shared

if TYPE_CHECKING:
    from sgl.sched.models.llama import LlamaForCausalLM
    from sgl.sched.models.model_config import AnyConfig

GROUP_TIMEOUT_S = 60.0
DISK_FORMATS = ("auto", "safetensors", "gguf")
_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}
_FLOATS = (*DTYPES, "float64")  # a checkpoint's float64 is converted like the others
# A checkpoint of "the same architecture" has these equal (None: the derived default).
_SAME = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
         "head_dim", "vocab_size", "tie_word_embeddings", "attention_bias", "mlp_bias")


@dataclass(frozen=True, slots=True)
class _Target:
    """Where one Hugging Face tensor goes: our parameter, its rows in it on this rank
    (a fused part; None: all of it), and the full tensor's shape."""

    param: str
    rows: tuple[int, int] | None
    shape: tuple[int, ...]


class WeightManager:
    def __init__(self, model: CausalLM, device: torch.device, dtype: torch.dtype, tp: TPGroup,
                 load_format: str) -> None:
        self.device = device
        self.dtype = dtype
        self.tp = tp
        self.load_format = load_format
        self._model = None if isinstance(model, NullModel) else cast("LlamaForCausalLM", model)
        self.groups: dict[str, UpdateGroup] = {}
        self.group_timeout_s = GROUP_TIMEOUT_S
        self._targets: dict[str, _Target] | None = None  # built at first use
        self._host: list[torch.Tensor] | None = None  # the parameters while released

    # ---- state ----

    @property
    def resident(self) -> bool:
        """The parameters are on the device (not released)."""
        return self._host is None

    def _loaded_model(self) -> LlamaForCausalLM:
        if self._model is None:
            raise ValueError(f"load_format={self.load_format!r} runs the null model, which has no weights")
        if self._host is not None:
            raise ValueError("the weights are released: resume_memory(['weights']) first")
        return self._model

    def targets(self) -> dict[str, _Target]:
        """Every Hugging Face name the model takes, and where it goes."""
        if self._targets is None:
            model = self._loaded_model()
            # Full shapes from a tensor-parallel-free twin without memory (the loader's way).
            whole = type(model)(model.config, dtype=model.dtype, device="meta")
            shapes = {hf: tuple(t.shape) for name, p in whole.named_parameters() for hf, t in whole.unfuse(name, p)}
            rows: dict[str, tuple[int, int]] = {}
            for name, p in model.named_parameters():
                for hf, view in model.unfuse(name, p.data):
                    if view.shape != p.shape:  # a fused part: its rows in our parameter on this rank
                        lo = (view.storage_offset() - p.data.storage_offset()) // p.data.stride(0)
                        rows[hf] = (lo, lo + view.shape[0])
            targets = {hf: _Target(ours.partition("#")[0], rows.get(hf), shapes[hf])
                       for ours, hf in model.expected_weights().items()}
            self._targets = targets
        return self._targets

    # ---- updates ----

    def from_disk(self, model_path: str, load_format: str | None = None) -> int:
        """Load every weight of a checkpoint of the same architecture (a safetensors
        directory or a .gguf file); returns the tensors loaded."""
        return self._copy(self._disk_tensors(model_path, load_format))

    def check_disk(self, model_path: str, load_format: str | None = None) -> None:
        """Refuse (ValueError) a checkpoint from_disk would refuse, reading its config and
        tensor headers only: before any request is aborted for the update."""
        self._disk_tensors(model_path, load_format)

    def check_tensors(self, spec: SharedTensors) -> None:
        """Refuse (ValueError) a shared buffer from_tensors would refuse, by its entries alone."""
        self._loaded_model()
        self._check(((e.name, e.shape, e.dtype) for e in spec.entries), "tensors", complete=False)

    def _disk_tensors(self, model_path: str, load_format: str | None) -> Iterable[tuple[str, torch.Tensor]]:
        """A checkpoint's tensors, read as iterated, once its config and headers passed the checks."""
        from sgl.sched.models.loader import (
            GGUFCheckpoint,
            _gguf_file,
            hf_config,
            safetensors_files,
            safetensors_tensors,
        )

        self._loaded_model()
        fmt = load_format or (self.load_format if self.load_format in DISK_FORMATS else "auto")
        if fmt not in DISK_FORMATS:
            raise ValueError(f"load_format={fmt!r} reads no checkpoint: use one of {', '.join(DISK_FORMATS)}")
        path = Path(model_path).expanduser()
        if not path.exists():
            raise ValueError(f"model_path={model_path!r} does not exist")
        gguf_file = _gguf_file(path, fmt)
        if gguf_file is not None:
            ckpt = GGUFCheckpoint(gguf_file)
            self._same_architecture(ckpt.config, model_path)
            # A dry pass over the header's shapes (GGUF lists dimensions fastest-first).
            self._check(((_gguf_name(ckpt, t.name, model_path), [int(d) for d in reversed(t.shape)], "float32")
                         for t in ckpt.reader.tensors), f"model_path={model_path!r}", complete=True)
            return iter(ckpt)
        config = hf_config(path)
        self._same_architecture(config, model_path)
        files = safetensors_files(path)
        header: Iterable[tuple[str, list[int], str]] = _safetensors_header(files)
        tensors: Iterable[tuple[str, torch.Tensor]] = safetensors_tensors(files)
        if (fp8 := Fp8Checkpoint.of(config)) is not None:  # dequantized as read; the model quantizes its own way
            header, tensors = fp8.header(header), fp8.dequantized(tensors)
        self._check(header, f"model_path={model_path!r}", complete=True)
        return tensors

    def from_tensors(self, spec: SharedTensors) -> int:
        """Copy in the tensors of a buffer another process shares (some or all of the
        model's); returns the tensors loaded. The buffer is closed, never unlinked."""
        self.check_tensors(spec)
        with open_shared(spec, self.device) as views:
            return self._copy(views)

    def init_group(self, req: InitWeightsUpdateGroupReq) -> None:
        """Join the trainer's group as rank `rank_offset + tp.rank`; blocks until every
        member joined, at most `group_timeout_s`."""
        if req.group_name in self.groups:
            raise ValueError(f"group_name={req.group_name!r}: this engine is in that group already")
        if req.backend == "nccl" and self.device.type != "cuda":
            raise ValueError(f"backend='nccl' needs a CUDA device and this engine runs on {self.device}: "
                             "use backend='gloo'")
        rank = req.rank_offset + self.tp.rank
        if req.rank_offset < 1 or rank >= req.world_size:
            raise ValueError(f"rank_offset={req.rank_offset}, world_size={req.world_size}: this engine's ranks "
                             f"{req.rank_offset}..{req.rank_offset + self.tp.size - 1} must lie in 1..world_size-1 "
                             "(rank 0 is the trainer)")
        if req.backend == "nccl":
            # NCCL's communicator goes on the current device (an indexed one: resolve_device).
            torch.cuda.set_device(self.device)
        self.groups[req.group_name] = init_update_group(
            req.master_address, req.master_port, rank, req.world_size, req.group_name, req.backend,
            self.group_timeout_s)

    def from_distributed(self, req: UpdateWeightsFromDistributedReq) -> int:
        """Receive each named tensor from rank 0's broadcast in the group, in order, and
        copy them all in once all arrived; returns the tensors loaded."""
        self._loaded_model()
        n = len(req.names)
        if not n or len(req.dtypes) != n or len(req.shapes) != n:
            raise ValueError(f"names, dtypes and shapes must be non-empty lists of equal length, got "
                             f"{n}, {len(req.dtypes)} and {len(req.shapes)}")
        group = self.groups.get(req.group_name)
        if group is None:
            raise ValueError(f"group_name={req.group_name!r}: no such weight update group "
                             f"(joined: {sorted(self.groups) or 'none'}); init_weights_update_group first")
        self._check(zip(req.names, req.shapes, req.dtypes), "names", complete=False)
        at = self.device if group.backend == "nccl" else torch.device("cpu")
        received = []
        for name, dtype, shape in zip(req.names, req.dtypes, req.shapes):
            t = torch.empty(shape, dtype=DTYPES[dtype], device=at)
            group.broadcast(t, src=0)
            received.append((name, t))
        return self._copy(received)

    def destroy_group(self, group_name: str) -> None:
        group = self.groups.pop(group_name, None)
        if group is None:
            raise ValueError(f"group_name={group_name!r}: no such weight update group "
                             f"(joined: {sorted(self.groups) or 'none'})")
        group.close()

    def close(self) -> None:
        """Leave every group."""
        for name in list(self.groups):
            self.destroy_group(name)

    def get(self, name: str, truncate_size: int = 100) -> list[float]:
        """The first `truncate_size` values of the Hugging Face-named parameter, flattened,
        as floats. Under tensor parallelism every rank must call it (the full tensor is
        gathered over the group) and every rank returns the full tensor's values."""
        model = self._loaded_model()
        if truncate_size < 0:
            raise ValueError(f"truncate_size={truncate_size} is negative")
        if name == "lm_head.weight" and model.lm_head is None:
            name = "model.embed_tokens.weight"  # tied: the LM head is the embedding
        target = self.targets().get(name)
        if target is None:
            raise ValueError(f"name={name!r}: no such weight{_close(name, self.targets())}")
        with torch.no_grad():
            part = model.weight_values(target.param)
            if target.rows is not None:
                part = part[target.rows[0]:target.rows[1]]
            full = self._gather(name, target, part) if self.tp.size > 1 else part
            return full.flatten()[:truncate_size].float().cpu().tolist()

    # ---- memory ----

    def release(self) -> None:
        """Move every parameter off the device: its values wait in host memory (pinned on
        CUDA; on a CPU the tensors themselves wait) and the parameter holds an empty tensor.
        Fails before changing anything (e.g. out of pinned memory)."""
        if self._host is not None:
            raise ValueError("the weights are released already")
        params = self._params()
        if self.device.type == "cpu":
            host = [p.data for p in params]
        else:
            host = [torch.empty(p.shape, dtype=p.dtype, pin_memory=True) for p in params]
            for h, p in zip(host, params):
                h.copy_(p.data, non_blocking=True)
            torch.cuda.synchronize(self.device)
        for p in params:
            p.data = torch.empty(0, dtype=p.dtype, device=self.device)
        self._host = host

    def resume(self) -> None:
        """Bring the released parameters back to the device (new storage: CUDA graphs
        must be captured again). Fails before changing anything (e.g. out of memory)."""
        if self._host is None:
            raise ValueError("the weights are not released")
        params = self._params()
        if self.device.type == "cpu":
            back = self._host
        else:
            back = [torch.empty(h.shape, dtype=h.dtype, device=self.device) for h in self._host]
            for b, h in zip(back, self._host):
                b.copy_(h, non_blocking=True)
            torch.cuda.synchronize(self.device)
        for p, b in zip(params, back):
            p.data = b
        self._host = None

    def _params(self) -> list[torch.nn.Parameter]:
        return [] if self._model is None else list(self._model.parameters())

    # ---- the steps every update shares ----

    def _same_architecture(self, config: AnyConfig, model_path: str) -> None:
        from sgl.sched.models.llama import rope_settings
        from sgl.sched.models.registry import model_class

        model = self._loaded_model()
        ours = model.config
        diffs = []
        if model_class(getattr(config, "architectures", None)) is not type(model):
            diffs.append(f"architectures {getattr(config, 'architectures', None)} "
                         f"(running: {getattr(ours, 'architectures', None)})")
        for key in _SAME:
            theirs, mine = _setting(config, key), _setting(ours, key)
            if theirs != mine:
                diffs.append(f"{key} {theirs} (running: {mine})")
        (theta, scaling), (my_theta, my_scaling) = rope_settings(config), rope_settings(ours)
        scaling, my_scaling = _without_theta(scaling), _without_theta(my_scaling)
        if not math.isclose(theta, my_theta, rel_tol=1e-6) or scaling != my_scaling:
            diffs.append(f"rope theta {theta} and scaling {scaling} (running: {my_theta}, {my_scaling})")
        if not math.isclose(config.rms_norm_eps, ours.rms_norm_eps, rel_tol=1e-5):
            diffs.append(f"rms_norm_eps {config.rms_norm_eps} (running: {ours.rms_norm_eps})")
        if diffs:
            raise ValueError(f"model_path={model_path!r} is not a checkpoint of the running model's architecture: "
                             + "; ".join(diffs))

    def _check(self, items: Iterable[tuple[str, Sequence[int], str]], source: str, complete: bool) -> None:
        """ValueError naming the first tensor (name, shape, dtype name) that the model
        does not take; with `complete`, also the weights none of them fills."""
        model, targets = self._loaded_model(), self.targets()
        seen: set[str] = set()
        for name, shape, dtype in items:
            if _skipped(name, model):
                continue
            target = targets.get(name)
            if target is None:
                raise ValueError(f"{source}: unexpected weight {name!r}{_close(name, targets)}")
            if name in seen:
                raise ValueError(f"{source}: weight {name!r} is given twice")
            if tuple(shape) != target.shape:
                raise ValueError(f"{source}: weight {name!r} has shape {tuple(shape)}, expected {target.shape}")
            if dtype not in _FLOATS:
                raise ValueError(f"{source}: weight {name!r} has dtype {dtype!r}; expected one of "
                                 f"{', '.join(_FLOATS)}")
            seen.add(name)
        missing = sorted(set(targets) - seen) if complete else []
        if missing:
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise ValueError(f"missing weights in {source}: {shown}; is the checkpoint complete and for this "
                             "architecture?")

    def _copy(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy checked tensors in place; the count copied (skipped names not counted)."""
        model = self._loaded_model()
        copied = 0

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal copied
            for name, t in tensors:
                if not _skipped(name, model):
                    copied += 1
                    yield name, t

        with torch.no_grad():
            model.load_weights(counted())
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the sender may free its tensors once this returns
        return copied

    def _gather(self, name: str, target: _Target, part: torch.Tensor) -> torch.Tensor:
        """The full Hugging Face tensor from every rank's part (the inverse of the
        model's sharding, sgl.sched.models.llama's `_rank_part`)."""
        model = self._loaded_model()
        parts = [torch.empty_like(part) for _ in range(self.tp.size)]
        dist.all_gather(parts, part.contiguous(), group=self.tp.group)
        kind = target.param.split(".")[-2]
        if kind in ("embed_tokens", "lm_head"):
            return torch.cat(parts)[: model.vocab_size]
        if kind not in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj") or name.endswith(
                ("o_proj.bias", "down_proj.bias")):
            return part  # replicated: norms, and o/down biases (added once, after the sum)
        if kind in ("o_proj", "down_proj"):
            return torch.cat(parts, dim=1)
        if kind == "qkv_proj" and ".q_proj." not in name:
            # KV heads fewer than ranks are replicated: one part per distinct first head.
            kv = model.config.num_key_value_heads
            firsts = [r * kv // self.tp.size for r in range(self.tp.size)]
            parts = [p for r, p in enumerate(parts) if r == 0 or firsts[r] != firsts[r - 1]]
        return torch.cat(parts)


def _setting(config: Any, key: str) -> Any:
    value = getattr(config, key, None)
    if key == "head_dim" and value is None:
        return config.hidden_size // config.num_attention_heads
    if key == "num_key_value_heads" and value is None:
        return config.num_attention_heads
    if key in ("tie_word_embeddings", "attention_bias", "mlp_bias"):
        return bool(value)
    return value


def _without_theta(scaling: dict | None) -> dict | None:
    return None if scaling is None else {k: v for k, v in scaling.items() if k != "rope_theta"}


def _skipped(name: str, model: LlamaForCausalLM) -> bool:
    """Names `load_weights` passes over: rotary tables, a tied model's stored LM head copy."""
    return name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and model.lm_head is None)


def _close(name: str, names: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(names), n=3, cutoff=0.6)
    return f"; close names: {', '.join(close)}" if close else ""


def _gguf_name(ckpt: Any, gguf_name: str, model_path: str) -> str:
    try:
        return str(ckpt.hf_name(gguf_name))
    except KeyError as e:
        raise ValueError(f"model_path={model_path!r}: {e.args[0]}") from None


def _safetensors_header(files: list[Path]) -> Iterator[tuple[str, list[int], str]]:
    """Every tensor's name, shape and dtype from the files' headers (no data read)."""
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                s = fh.get_slice(name)
                yield name, list(s.get_shape()), _SAFETENSORS_DTYPES.get(s.get_dtype(), s.get_dtype())
