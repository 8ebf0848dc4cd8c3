"""The control plane's arguments on the caller's side: each engine method's arguments
checked (a FieldError, a ValueError naming the field) and made into its protocol request, and a
`ControlReqOutput` made into what the method returns. Nothing here sends anything;
the checks are the caller's, so a bad call never reaches the scheduler."""

from __future__ import annotations

import typing
from collections.abc import Mapping
from typing import Any

from sgl.core.lora_rules import NAME_RULE, is_name
from sgl.core.protocol import (
    MEMORY_TAGS,
    ControlReqOutput,
    DestroyWeightsUpdateGroupReq,
    GetWeightsByNameReq,
    InitWeightsUpdateGroupReq,
    LoadLoraAdapterReq,
    MemoryTag,
    PauseGenerationReq,
    PauseMode,
    ReleaseMemoryReq,
    ResumeMemoryReq,
    SharedTensors,
    UnloadLoraAdapterReq,
    UpdateWeightsFromDiskReq,
    UpdateWeightsFromDistributedReq,
    UpdateWeightsFromTensorReq,
)
from sgl.core.server_args import ServerArgs

PAUSE_MODES: tuple[PauseMode, ...] = typing.get_args(PauseMode)
LOAD_FORMATS: tuple[str, ...] = typing.get_args(typing.get_type_hints(ServerArgs)["load_format"])
BACKENDS = ("nccl", "gloo")
# torch's dtype names without "torch."; which ones a model takes is the scheduler's call.
DTYPES = frozenset({"float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2", "int8", "uint8",
                    "int16", "int32", "int64", "bool"})
DEFAULT_GROUP = "weight_update_group"
MAX_TRUNCATE_SIZE = 1 << 20  # values get_weights_by_name returns at most (~9 MB on the wire)
MAX_NAME_CHARS = 1024  # a parameter's, a group's, a weight version's
MAX_TENSORS = 1 << 16  # names of one distributed update
MAX_DIMS = 8


class FieldError(ValueError):
    """An invalid argument: `field` is its name (a list's, for one of its entries), as an
    HTTP error's `param`."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _base(field: str) -> str:
    return field.split("[", 1)[0].split(" ", 1)[0]


def invalid(field: str, value: Any, must: str) -> FieldError:
    return FieldError(_base(field), f"{field}={value!r} is invalid: {must}")


def check_bool(field: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise invalid(field, value, "must be a bool")
    return value


def check_int(field: str, value: Any, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise invalid(field, value, f"must be an int in [{low}, {high}]")
    return value


def check_name(field: str, value: Any) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_NAME_CHARS:
        raise invalid(field, value, f"must be a non-empty str of at most {MAX_NAME_CHARS} characters")
    return value


def check_version(value: Any) -> str | None:
    return None if value is None else check_name("weight_version", value)


def pause(mode: Any, refuse_new: Any) -> PauseGenerationReq:
    if mode not in PAUSE_MODES:
        raise invalid("mode", mode, f"must be one of {', '.join(PAUSE_MODES)}")
    return PauseGenerationReq(mode=mode, refuse_new=check_bool("refuse_new", refuse_new))


def abort_target(rid: Any, abort_all: Any) -> str | None:
    """The rid to abort, or None to abort every request (SGLang's `abort_all`, which
    wins over a rid given with it)."""
    if check_bool("abort_all", abort_all):
        if rid is not None and not isinstance(rid, str):
            raise invalid("rid", rid, "must be a str")
        return None
    if not isinstance(rid, str) or not rid:
        raise invalid("rid", rid, "give a request id, or abort_all=True")
    return rid


def _update(flush_cache: Any, abort_all_requests: Any, weight_version: Any) -> dict[str, Any]:
    return {"flush_cache": check_bool("flush_cache", flush_cache),
            "abort_all_requests": check_bool("abort_all_requests", abort_all_requests),
            "weight_version": check_version(weight_version)}


def from_disk(model_path: Any, load_format: Any, flush_cache: Any, abort_all_requests: Any,
              weight_version: Any) -> UpdateWeightsFromDiskReq:
    if not isinstance(model_path, str) or not model_path:
        raise invalid("model_path", model_path, "must be a checkpoint's directory or .gguf file")
    if load_format is not None and load_format not in LOAD_FORMATS:
        raise invalid("load_format", load_format, f"must be one of {', '.join(LOAD_FORMATS)}, or None (as the "
                      "engine was started)")
    return UpdateWeightsFromDiskReq(model_path=model_path, load_format=load_format,
                                    **_update(flush_cache, abort_all_requests, weight_version))


def named_items(named_tensors: Any) -> list[tuple[str, Any]]:
    """(name, tensor) pairs from a list of pairs or a dict, names checked and unique."""
    items = list(named_tensors.items()) if isinstance(named_tensors, Mapping) else named_tensors
    if not isinstance(items, (list, tuple)) or not items:
        raise FieldError("named_tensors", "named_tensors is invalid: must be a non-empty list of (name, tensor) "
                         "pairs, a dict of them, or a SharedTensors")
    out: list[tuple[str, Any]] = []
    for i, item in enumerate(items):
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise FieldError("named_tensors", f"named_tensors[{i}] is invalid: must be a (name, tensor) pair")
        if not all(hasattr(item[1], a) for a in ("shape", "dtype", "device")):  # a tensor, without importing torch
            raise FieldError("named_tensors", f"named_tensors[{i}] is invalid: its value is a "
                             f"{type(item[1]).__name__}, not a torch.Tensor")
        out.append((check_name(f"named_tensors[{i}] name", item[0]), item[1]))
    if len({name for name, _ in out}) != len(out):
        raise FieldError("named_tensors", "named_tensors is invalid: a name appears twice")
    return out


def tensor_options(load_format: Any, flush_cache: Any, abort_all_requests: Any,
                   weight_version: Any) -> dict[str, Any]:
    """The checked options of an update from tensors (checked before any tensor is packed)."""
    if load_format is not None:
        raise invalid("load_format", load_format, "tensors are loaded by their Hugging Face names; pass None")
    return _update(flush_cache, abort_all_requests, weight_version)


def from_tensor(spec: Any, options: dict[str, Any]) -> UpdateWeightsFromTensorReq:
    if not isinstance(spec, SharedTensors) or not spec.entries:
        raise FieldError("named_tensors", "named_tensors is invalid: the SharedTensors holds no tensor")
    return UpdateWeightsFromTensorReq(tensors=spec, **options)


def init_group(master_address: Any, master_port: Any, rank_offset: Any, world_size: Any, group_name: Any,
               backend: Any) -> InitWeightsUpdateGroupReq:
    check_name("master_address", master_address)
    check_int("master_port", master_port, 1, 65535)
    check_int("world_size", world_size, 2, 1 << 20)
    check_int("rank_offset", rank_offset, 1, world_size - 1)  # rank 0 is the trainer's
    if backend not in BACKENDS:
        raise invalid("backend", backend, f"must be one of {', '.join(BACKENDS)}")
    return InitWeightsUpdateGroupReq(master_address=master_address, master_port=master_port,
                                     rank_offset=rank_offset, world_size=world_size,
                                     group_name=check_name("group_name", group_name), backend=backend)


def _dtype(i: int, value: Any) -> str:
    name = value.removeprefix("torch.") if isinstance(value, str) else value
    if name not in DTYPES:
        raise invalid(f"dtypes[{i}]", value, f"must be one of {', '.join(sorted(DTYPES))}")
    return str(name)


def _shape(i: int, value: Any) -> list[int]:
    if not isinstance(value, (list, tuple)) or len(value) > MAX_DIMS:
        raise invalid(f"shapes[{i}]", value, f"must be a list of at most {MAX_DIMS} ints")
    return [check_int(f"shapes[{i}][{d}]", n, 0, 1 << 40) for d, n in enumerate(value)]


def from_distributed(names: Any, dtypes: Any, shapes: Any, group_name: Any, flush_cache: Any,
                     abort_all_requests: Any, weight_version: Any) -> UpdateWeightsFromDistributedReq:
    for field, value in (("names", names), ("dtypes", dtypes), ("shapes", shapes)):
        if not isinstance(value, (list, tuple)) or not value or len(value) > MAX_TENSORS:
            raise FieldError(field, f"{field} is invalid: must be a non-empty list of at most {MAX_TENSORS} "
                             "entries")
    if not len(names) == len(dtypes) == len(shapes):
        raise FieldError("names", f"names, dtypes and shapes are invalid: their lengths differ ({len(names)}, "
                         f"{len(dtypes)}, {len(shapes)}); give one dtype and one shape per name")
    checked = [check_name(f"names[{i}]", n) for i, n in enumerate(names)]
    if len(set(checked)) != len(checked):
        raise FieldError("names", "names is invalid: a name appears twice")
    return UpdateWeightsFromDistributedReq(
        names=checked, dtypes=[_dtype(i, d) for i, d in enumerate(dtypes)],
        shapes=[_shape(i, s) for i, s in enumerate(shapes)], group_name=check_name("group_name", group_name),
        **_update(flush_cache, abort_all_requests, weight_version))


def destroy_group(group_name: Any) -> DestroyWeightsUpdateGroupReq:
    return DestroyWeightsUpdateGroupReq(group_name=check_name("group_name", group_name))


def get_weights(name: Any, truncate_size: Any) -> GetWeightsByNameReq:
    return GetWeightsByNameReq(name=check_name("name", name),
                               truncate_size=check_int("truncate_size", truncate_size, 0, MAX_TRUNCATE_SIZE))


def memory_tags(tags: Any) -> list[MemoryTag] | None:
    if tags is None:
        return None
    if not isinstance(tags, (list, tuple)) or not tags or any(t not in MEMORY_TAGS for t in tags):
        raise invalid("tags", tags, f"must be None (all) or a non-empty list of {', '.join(MEMORY_TAGS)}")
    if len(set(tags)) != len(tags):
        raise invalid("tags", tags, "a tag appears twice")
    return list(tags)


def release(tags: Any) -> ReleaseMemoryReq:
    return ReleaseMemoryReq(tags=memory_tags(tags))


def resume(tags: Any) -> ResumeMemoryReq:
    return ResumeMemoryReq(tags=memory_tags(tags))


def lora_name(value: Any) -> str:
    if not is_name(value):
        raise invalid("lora_name", value, NAME_RULE)
    return str(value)


def load_lora(name: Any, path: Any) -> LoadLoraAdapterReq:
    if not isinstance(path, str) or not path.strip():
        raise invalid("lora_path", path, "must be the adapter's folder (PEFT's adapter_config.json and weights)")
    return LoadLoraAdapterReq(lora_name=lora_name(name), lora_path=path)


def unload_lora(name: Any) -> UnloadLoraAdapterReq:
    return UnloadLoraAdapterReq(lora_name=lora_name(name))


def result(out: ControlReqOutput) -> dict[str, Any]:
    """SGLang's reply: {"success": True, "message", **data}; a refusal raises
    ValueError(message) (the engine is then as it was)."""
    if not out.success:
        raise ValueError(out.message or "the scheduler refused the request")
    return {**out.data, "success": True, "message": out.message}
