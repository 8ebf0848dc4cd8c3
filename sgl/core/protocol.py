"""The messages the three roles exchange, as one tagged union of msgspec Structs.

Bottom layer: imports only sgl's other data modules. Every message is a Struct
with a tag; the codec in sgl.transports rejects unknown tags and wrong types.
Request ids (rids) are strings chosen by the tokenizer manager."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from sgl.core.faults import FaultSpec
from sgl.core.sampling_params import SamplingParams

# {"type": "stop", "matched": int | str} | {"type": "length", "length": int} |
# {"type": "abort", "message": str}
FinishReason = dict[str, Any]


class GenerateReqInput(msgspec.Struct, tag="generate", forbid_unknown_fields=True):
    """A tokenized request, tokenizer manager -> scheduler."""

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1  # first prompt position whose logprob is returned; -1: none
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    custom_logit_processor: str | None = None
    detokenize: bool = True
    # n > 1: the rid of the first sample; this one waits until that one's prompt is cached.
    prefix_leader: str | None = None
    # An embedding request (max_new_tokens=0): its result is its prompt's pooled final
    # hidden states (sgl.sched.models.pooling), in the output's `embeddings` column.
    embed: bool = False
    priority: int = 0  # higher is more urgent (SGLang's); used by schedule_policy="priority"
    # Seconds from the scheduler's receipt within which it must finish, else it ends with an
    # abort naming the deadline; None: the server's request_timeout (None there: no deadline).
    timeout: float | None = None
    # The LoRA adapter (by name) that runs this request; None: the base model.
    lora_path: str | None = None


class Logprobs(msgspec.Struct, forbid_unknown_fields=True, array_like=True):
    """Log-probabilities a request produced since the last message (log_softmax of the
    raw logits). Input positions carry None where no logprob exists (the first token)."""

    output_vals: list[float] = []
    output_top_vals: list[list[float]] = []
    output_top_ids: list[list[int]] = []
    output_ids_vals: list[list[float]] = []  # at the request's token_ids_logprob
    input_ids: list[int] = []
    input_vals: list[float | None] = []
    input_top_vals: list[list[float] | None] = []
    input_top_ids: list[list[int] | None] = []
    input_ids_vals: list[list[float] | None] = []

    def drop_prompt(self, keep_first: bool = False) -> None:
        """Forget the prompt positions gathered so far (all but the leading None with
        `keep_first`): its prefill starts again, or it ended before its prompt's logprobs
        were all in, and a caller gets all of them or none."""
        keep = 1 if keep_first and self.input_vals else 0
        for vals in (self.input_ids, self.input_vals, self.input_top_vals, self.input_top_ids, self.input_ids_vals):
            del vals[keep:]  # an unused list is empty: nothing to drop

    def whole_prompt_or_none(self, positions: int) -> None:
        """At a request's end: its prompt's `positions` logprobs all, or none of them (it
        ended before its prefill's results came in). None of them was sent before they were
        all in: they go with the first token."""
        if 0 < len(self.input_vals) < positions:
            self.drop_prompt()


class Beam(msgspec.Struct, forbid_unknown_fields=True, array_like=True):
    """One finished beam of a beam-search request, best first in its list. `text` is
    filled in by the detokenizer (empty when the request asked detokenize=False)."""

    output_ids: list[int]
    cumulative_logprob: float  # sum of the chosen tokens' log-probabilities (after processors and masks)
    score: float  # cumulative_logprob / len(output_ids) ** length_penalty
    finish_reason: FinishReason
    text: str = ""


class AbortReq(msgspec.Struct, tag="abort", forbid_unknown_fields=True):
    rid: str


class BatchTokenIDOutput(msgspec.Struct, tag="batch_token_ids", forbid_unknown_fields=True):
    """Scheduler -> detokenizer: the ids each request produced since the last message.

    Column-wise lists, one entry per rid. A finished request appears once more with
    its finish reason and is then forgotten by both ends."""

    rids: list[str]
    new_ids: list[list[int]]
    finished_reasons: list[FinishReason | None]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    skip_special_tokens: list[bool]
    spaces_between_special_tokens: list[bool]
    no_stop_trim: list[bool]
    stop_strs: list[list[str]]  # for holding back a streamed tail that may start a stop string
    detokenize: list[bool]
    logprobs: list[Logprobs | None]
    # A finished beam-search request's beams, best first (None for other requests). Its
    # new_ids are empty: the beams carry the ids.
    beams: list[list[Beam] | None] = []
    weight_version: str = "default"  # of the weights that made these tokens
    # A finished embedding request's vector as little-endian float32 bytes (None for others).
    embeddings: list[bytes | None] = []


class BatchStrOutput(msgspec.Struct, tag="batch_str", forbid_unknown_fields=True):
    """Detokenizer -> tokenizer manager: new text (a delta) and new ids per rid."""

    rids: list[str]
    texts: list[str]
    new_ids: list[list[int]]
    finished_reasons: list[FinishReason | None]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    logprobs: list[Logprobs | None]
    beams: list[list[Beam] | None] = []  # with each beam's text, as in BatchTokenIDOutput
    weight_version: str = "default"
    embeddings: list[bytes | None] = []  # as in BatchTokenIDOutput


class FlushCacheReq(msgspec.Struct, tag="flush_cache", forbid_unknown_fields=True):
    origin: str = ""  # the asking tokenizer manager's client id ("": the engine's own)
    req_id: int = 0  # echoed in the reply, which the tokenizer manager matches by it


class FlushCacheReqOutput(msgspec.Struct, tag="flush_cache_out", forbid_unknown_fields=True):
    success: bool
    message: str = ""
    origin: str = ""
    req_id: int = 0  # the request's


class GetServerInfoReq(msgspec.Struct, tag="server_info", forbid_unknown_fields=True):
    origin: str = ""  # the asking tokenizer manager's client id ("": the engine's own)
    req_id: int = 0  # echoed in the reply, which the tokenizer manager matches by it


class GetServerInfoReqOutput(msgspec.Struct, tag="server_info_out", forbid_unknown_fields=True):
    info: dict[str, Any]
    origin: str = ""
    req_id: int = 0  # the request's


class HealthCheckReq(msgspec.Struct, tag="health", forbid_unknown_fields=True):
    origin: str = ""  # the asking tokenizer manager's client id ("": the engine's own)
    req_id: int = 0  # echoed in the reply, which the tokenizer manager matches by it


class HealthCheckOutput(msgspec.Struct, tag="health_out", forbid_unknown_fields=True):
    ok: bool
    origin: str = ""
    req_id: int = 0  # the request's


class SetFaultsReq(msgspec.Struct, tag="set_faults", forbid_unknown_fields=True):
    """A test's fault plan for the scheduler (sgl.testing.inject_faults): it replaces the
    one installed; None removes it."""

    faults: list[FaultSpec] | None
    origin: str = ""  # the asking tokenizer manager's client id ("": the engine's own)
    req_id: int = 0  # echoed in the reply, which the tokenizer manager matches by it


class SetFaultsReqOutput(msgspec.Struct, tag="set_faults_out", forbid_unknown_fields=True):
    success: bool
    message: str = ""  # why the plan was refused
    origin: str = ""
    req_id: int = 0  # the request's


# ---- the control plane: pause, abort all, weights, memory (sgl.sched.control) ----

# abort: running and waiting requests end (reason "abort"); retract: running requests go
# back to waiting with their progress kept; in_place: nothing moves, nothing is scheduled.
PauseMode = Literal["abort", "retract", "in_place"]
MemoryTag = Literal["weights", "kv_cache"]
MEMORY_TAGS: tuple[MemoryTag, ...] = ("weights", "kv_cache")
# The abort messages of the requests the control plane ends.
PAUSED_ABORT = "aborted: the engine's generation was paused (pause_generation mode='abort')"
ABORTED_ALL = "aborted: abort_all"
UPDATE_ABORT = "aborted: a weight update with abort_all_requests"
# The 503 reason of a request refused while paused with refuse_new.
PAUSED_REFUSAL = "the engine is paused (pause_generation with refuse_new): retry after continue_generation"
# Why a grammar request is refused (a 400, after the grammar's field name): the scheduler's
# compile and sgl.testing's fake say it alike.
GRAMMAR_UNCOMPILED = "the grammar does not compile"
GRAMMAR_EMPTY = "the grammar matches no text (not even an empty output)"


class ControlReqOutput(msgspec.Struct, tag="control_out", forbid_unknown_fields=True, kw_only=True):
    """The reply to every control-plane request below: `message` says why on failure
    (the engine is then as it was); `data` holds the call's results (e.g.
    "weight_version", "num_paused_requests", "parameter", "aborted")."""

    success: bool
    message: str = ""
    data: dict[str, Any] = {}
    origin: str = ""
    req_id: int = 0  # the request's


class PauseGenerationReq(msgspec.Struct, tag="pause", forbid_unknown_fields=True, kw_only=True):
    """Stop generating (PauseMode). New requests wait for `ContinueGenerationReq`, or
    with `refuse_new` end at once with a 503-like abort reason."""

    mode: PauseMode = "abort"
    refuse_new: bool = False
    origin: str = ""
    req_id: int = 0


class ContinueGenerationReq(msgspec.Struct, tag="continue", forbid_unknown_fields=True, kw_only=True):
    origin: str = ""
    req_id: int = 0


class AbortAllReq(msgspec.Struct, tag="abort_all", forbid_unknown_fields=True, kw_only=True):
    """Abort every live request (queued, compiling, prefilling, running); reply once they ended."""

    origin: str = ""
    req_id: int = 0


class WeightUpdate(msgspec.Struct, kw_only=True):
    """What every weight update shares. flush_cache: drop the radix cache (its KV was
    made by the old weights; requests holding KV are retracted and recompute it);
    abort_all_requests: abort every live request first, else the update waits until no
    request runs (a paused engine's requests wait for it); weight_version: the new
    version (default: the count of updates so far, as a string)."""

    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    origin: str = ""
    req_id: int = 0


class UpdateWeightsFromDiskReq(WeightUpdate, tag="update_weights_disk", forbid_unknown_fields=True, kw_only=True):
    """Load a checkpoint of the same architecture (a safetensors directory or a .gguf file)."""

    model_path: str
    load_format: str | None = None  # None: as the engine was started ("auto" finds the format)


class TensorEntry(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    name: str  # a Hugging Face parameter name (q_proj, not our fused qkv_proj)
    dtype: str  # torch's name without "torch.": float32, bfloat16, float16
    shape: list[int]
    offset: int  # bytes from the buffer's start


class CudaIpcHandle(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """torch's CUDA IPC share of one storage (UntypedStorage._share_cuda_), field for field."""

    device: int
    handle: bytes
    size: int
    offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


class SharedTensors(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Named tensors packed in one buffer another process opens without pickle: a CPU
    shared-memory block (`shm_name`) or a CUDA allocation (`cuda`); made by
    sgl.weights.share_tensors, which the sender keeps open until the update returned."""

    entries: list[TensorEntry]
    nbytes: int
    shm_name: str = ""
    cuda: CudaIpcHandle | None = None


class UpdateWeightsFromTensorReq(WeightUpdate, tag="update_weights_tensor", forbid_unknown_fields=True,
                                 kw_only=True):
    tensors: SharedTensors


class InitWeightsUpdateGroupReq(msgspec.Struct, tag="init_update_group", forbid_unknown_fields=True, kw_only=True):
    """Join a trainer's torch.distributed group as rank `rank_offset + tp_rank`; the
    trainer is rank 0 and broadcasts. backend: "nccl" (GPU) or "gloo" (CPU)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"
    origin: str = ""
    req_id: int = 0


class UpdateWeightsFromDistributedReq(WeightUpdate, tag="update_weights_dist", forbid_unknown_fields=True,
                                      kw_only=True):
    """Receive each named tensor from rank 0's broadcast in the group, in this order."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"


class DestroyWeightsUpdateGroupReq(msgspec.Struct, tag="destroy_update_group", forbid_unknown_fields=True,
                                   kw_only=True):
    group_name: str = "weight_update_group"
    origin: str = ""
    req_id: int = 0


class GetWeightsByNameReq(msgspec.Struct, tag="get_weights", forbid_unknown_fields=True, kw_only=True):
    """The first `truncate_size` values of a Hugging Face-named parameter, flattened."""

    name: str
    truncate_size: int = 100
    origin: str = ""
    req_id: int = 0


class ReleaseMemoryReq(msgspec.Struct, tag="release_memory", forbid_unknown_fields=True, kw_only=True):
    """Free the device memory of the weights and/or the KV pool (None: both)."""

    tags: list[MemoryTag] | None = None
    origin: str = ""
    req_id: int = 0


class ResumeMemoryReq(msgspec.Struct, tag="resume_memory", forbid_unknown_fields=True, kw_only=True):
    tags: list[MemoryTag] | None = None
    origin: str = ""
    req_id: int = 0


class LoadLoraAdapterReq(msgspec.Struct, tag="load_lora", forbid_unknown_fields=True, kw_only=True):
    """Load a PEFT adapter from `lora_path` under `lora_name` (requests then name it). A
    malformed adapter, a rank or module the engine cannot hold, or a name in use is
    refused, and nothing already loaded changes. The reply's data: "loaded_adapters"
    ({name: path})."""

    lora_name: str
    lora_path: str
    origin: str = ""
    req_id: int = 0


class UnloadLoraAdapterReq(msgspec.Struct, tag="unload_lora", forbid_unknown_fields=True, kw_only=True):
    """Unload an adapter; refused while a live request (queued or running) uses it."""

    lora_name: str
    origin: str = ""
    req_id: int = 0


CONTROL_PLANE = (PauseGenerationReq, ContinueGenerationReq, AbortAllReq, UpdateWeightsFromDiskReq,
                 UpdateWeightsFromTensorReq, InitWeightsUpdateGroupReq, UpdateWeightsFromDistributedReq,
                 DestroyWeightsUpdateGroupReq, GetWeightsByNameReq, ReleaseMemoryReq, ResumeMemoryReq,
                 LoadLoraAdapterReq, UnloadLoraAdapterReq)


class AttachReq(msgspec.Struct, tag="attach", forbid_unknown_fields=True):
    """A tokenizer manager in another process asks for its outputs at `address`.

    Sent to the scheduler, which passes it on to the detokenizer. From then on the
    detokenizer routes outputs of rids that start with `client_id + ":"`, and
    control replies whose origin is `client_id`, to `address`."""

    client_id: str
    address: str


class AttachReqOutput(msgspec.Struct, tag="attach_out", forbid_unknown_fields=True):
    client_id: str
    ok: bool
    message: str = ""


class DetachReq(msgspec.Struct, tag="detach", forbid_unknown_fields=True):
    client_id: str


class ShutdownReq(msgspec.Struct, tag="shutdown", forbid_unknown_fields=True):
    pass


TokenizerOp = Literal["encode", "chat", "decode", "token_strs", "vocab_texts"]


class TokenizerCall(msgspec.Struct, tag="tokenizer_call", forbid_unknown_fields=True, kw_only=True):
    """Tokenizer manager -> the tokenizer's process (the detokenizer's): one piece of
    tokenizer work, so the caller's process never loads a tokenizer.

    - encode: `texts` -> `ids`, one list per text (`add_special_tokens`).
    - chat: `conversation` through the chat template (`add_generation_prompt`,
      `continue_final_message`, `tools`, `template_kwargs`), then encoded -> `ids[0]`.
    - decode: `ids` -> `texts` (`skip_special_tokens`).
    - token_strs: `ids` -> `strs`, each id's vocabulary string.
    - vocab_texts: each of the first `size` ids decoded alone -> `texts` (logprob texts)."""

    op: TokenizerOp
    texts: list[str] = []
    ids: list[list[int]] = []
    conversation: list[dict[str, Any]] = []
    tools: list[dict[str, Any]] | None = None
    template_kwargs: dict[str, Any] = {}
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = True
    skip_special_tokens: bool = False
    size: int = 0
    req_id: int = 0  # echoed in the reply, which the tokenizer manager matches by it


class TokenizerCallOutput(msgspec.Struct, tag="tokenizer_call_out", forbid_unknown_fields=True, kw_only=True):
    """The answer to a TokenizerCall; `error` set (the rest empty) when the tokenizer or
    the chat template refused the input."""

    ids: list[list[int]] = []
    texts: list[str] = []
    strs: list[list[str]] = []
    error: str | None = None
    req_id: int = 0


Message = (
    GenerateReqInput
    | AbortReq
    | BatchTokenIDOutput
    | BatchStrOutput
    | FlushCacheReq
    | FlushCacheReqOutput
    | GetServerInfoReq
    | GetServerInfoReqOutput
    | HealthCheckReq
    | HealthCheckOutput
    | SetFaultsReq
    | SetFaultsReqOutput
    | ControlReqOutput
    | PauseGenerationReq
    | ContinueGenerationReq
    | AbortAllReq
    | UpdateWeightsFromDiskReq
    | UpdateWeightsFromTensorReq
    | InitWeightsUpdateGroupReq
    | UpdateWeightsFromDistributedReq
    | DestroyWeightsUpdateGroupReq
    | GetWeightsByNameReq
    | ReleaseMemoryReq
    | ResumeMemoryReq
    | LoadLoraAdapterReq
    | UnloadLoraAdapterReq
    | AttachReq
    | AttachReqOutput
    | DetachReq
    | ShutdownReq
    | TokenizerCall
    | TokenizerCallOutput
)

# Control replies travel scheduler -> detokenizer -> tokenizer manager unchanged.
CONTROL_REPLIES = (FlushCacheReqOutput, GetServerInfoReqOutput, HealthCheckOutput, SetFaultsReqOutput,
                   ControlReqOutput)
