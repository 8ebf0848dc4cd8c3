"""ServerArgs: every knob of an engine, with SGLang's names. Bottom layer: imports
nothing of sgl. Validated on construction; errors name the field."""

from __future__ import annotations

import re
from typing import Any, Literal

import msgspec

Transport = Literal["inproc", "ipc", "tcp"]
MAX_TIMEOUT_S = 86_400.0  # a request's deadline (its timeout, or request_timeout): at most a day
MAX_LORA_RANK = 256  # the largest LoRA rank an engine's adapter pool may hold
# An adapter's name, as requests give it (lora_path, or the OpenAI `model`).
LORA_NAME = re.compile(r"[A-Za-z0-9._\-/:]{1,128}")
MAX_DRAFT_TOKENS = 16  # tokens a speculative decode step verifies per request, at most
MAX_NGRAM_WINDOW = 64  # the longest suffix an n-gram proposal matches
LORA_NAME_RULE = "1 to 128 letters, digits and ._-/:"  # LORA_NAME, as errors say it


class ModelFiles(msgspec.Struct, frozen=True):
    """Where an engine's model and its tokenizer are, once found at the engine's start
    (`ServerArgs.model_files`): what every role loads."""

    model_path: str  # a Hugging Face model directory or a .gguf file
    tokenizer_path: str  # the same, for the tokenizer


class ServerArgs(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model_path: str | None = None  # None: the default model (SmolLM2-135M-Instruct)
    tokenizer_path: str | None = None
    # null: instant fake logits (pipeline benchmarks)
    load_format: Literal["auto", "safetensors", "gguf", "dummy", "null"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    trust_remote_code: bool = False
    context_length: int | None = None

    transport: Transport = "ipc"
    host: str = "127.0.0.1"  # the HTTP server's address, and the tcp transport's
    port: int = 30000  # the HTTP server's port (0: any free port)
    api_key: str | None = None  # Bearer token guarding every HTTP endpoint but /health
    # SGLang's: when set, the Bearer token of the control routes (pause, weights, memory,
    # flush_cache, abort_all), which the api_key no longer opens. None: the api_key.
    admin_api_key: str | None = None
    transport_key: str | None = None  # tcp transport shared HMAC secret (hex): the legacy mode, one identity for all
    # tcp transport CURVE keys: a folder from `sgl keys new DIR` (server.key_secret, allowed/,
    # admin/). None (and no transport_key): an ephemeral key pair per engine, no clients.
    transport_keys: str | None = None
    served_model_name: str | None = None  # the model's name on /v1 (default: the model directory's name)
    max_request_bytes: int = 4 * 1024 * 1024  # largest HTTP request body accepted
    # A Jinja chat template, or a file holding one, in place of the tokenizer's own.
    chat_template: str | None = None
    allow_origins: list[str] = []  # CORS: origins a browser may call the HTTP server from ("*": any)
    # Native /generate streams: each chunk the new text and ids only (default: everything so far, as SGLang).
    incremental_streaming_output: bool = False
    # OpenAI tool_choice "auto": how the model writes its tool calls (None: they stay content).
    tool_call_parser: Literal["hermes", "qwen", "qwen25", "llama3", "llama3_json", "mistral", "pythonic"] | None = None
    # Reasoning models: how the model marks its thinking, split from the answer in chat
    # (reasoning_content; None: it stays content). "generic" reads reasoning_markers.
    reasoning_parser: Literal["qwen3", "deepseek-r1", "generic"] | None = None
    reasoning_markers: list[str] = []  # with reasoning_parser="generic": the start and the end marker

    max_total_tokens: int | None = None  # KV slots; None: sized from memory
    mem_fraction_static: float | None = None
    max_running_requests: int | None = None
    max_prefill_tokens: int = 16384
    # Prompt tokens per prefill forward. None: by the device's memory (SGLang's defaults
    # below 90 GiB: 2048 under 35, 4096 under 60, 8192 under 90 (H100); 16384 from 90
    # (H200, B200: measured on an H200, sgl.sched.runner.model_runner); 2048 on CPU);
    # -1: no chunking (a whole prompt in one forward). Prompt-logprob rows are bounded
    # apart (sgl.sched.prefill.PROMPT_LOGPROB_BYTES).
    chunked_prefill_size: int | None = None
    # Waiting requests past which a new one is refused at once (an abort with status_code
    # 503; retracted requests always requeue). None: unbounded. 4096 is 16 batches of the
    # default 256 running requests: past that a new request would wait many times a typical
    # generation's length, so a fast "retry later" (or another replica) serves it better,
    # and the queue's per-round scans stay short.
    max_queued_requests: int | None = 4096
    # priority: the waiting queue by each request's `priority` (higher first, SGLang's order),
    # arrival order within one, lower-priority running requests retracted to make room.
    # With fcfs and lpm a request's priority is accepted and ignored (SGLang's default too).
    schedule_policy: Literal["fcfs", "lpm", "priority"] = "fcfs"
    # Seconds (from the scheduler's receipt) within which a request without its own `timeout`
    # must finish, else it ends with an abort naming the deadline. None: no deadline.
    request_timeout: float | None = None
    disable_radix_cache: bool = False
    # LoRA adapters (PEFT's format) served beside the base model, in one batch with it.
    # enable_lora: reserve the adapters' device pool even with no lora_paths (adapters loaded
    # later); None: on when lora_paths names any. lora_paths: "name=path" (or a path, named
    # by its folder) loaded at start. max_lora_rank: the largest rank the pool holds (None:
    # the largest of lora_paths, else 16); lora_target_modules: the projections adapters may
    # change (empty: all of q/k/v/o and gate/up/down); max_loras_per_batch: adapters on the
    # device at once, so in one batch (SGLang's default); max_loaded_loras: adapters held in
    # host memory at once.
    enable_lora: bool | None = None
    lora_paths: list[str] = []
    max_lora_rank: int | None = None
    lora_target_modules: list[Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                                      "all"]] = []
    max_loras_per_batch: int = 8
    max_loaded_loras: int = 64
    # Speculative decoding (SGLang's names). NGRAM: each decode step verifies, per request, its
    # last token and up to speculative_num_draft_tokens - 1 tokens proposed from the request's
    # own prompt and output (the longest of its last 1..12 tokens, by the two window sizes,
    # found earlier in them: what followed is the proposal); outputs are those of plain decode.
    # STANDALONE: a smaller model of the same tokenizer (speculative_draft_model_path) proposes
    # the tokens, its most likely one at a time.
    speculative_algorithm: Literal["NGRAM", "STANDALONE"] | None = None
    speculative_draft_model_path: str | None = None
    speculative_num_draft_tokens: int = 5
    speculative_ngram_min_match_window_size: int = 1
    speculative_ngram_max_match_window_size: int = 12
    # Speculate only while at most this many requests run; above it, plain steps under the
    # overlap loop (vLLM's name). None: always.
    speculative_disable_by_batch_size: int | None = None
    # Serve embeddings (engine.encode, /v1/embeddings) with a model whose files do not say
    # how to pool (no sentence-transformers modules.json); `pooling` overrides the files' mode.
    is_embedding: bool = False
    pooling: Literal["auto", "last", "mean"] = "auto"
    # None: the overlap loop on CUDA, off on CPU (there the forward's worker thread and
    # the scheduler fight for the same cores: W4 and W5 both ran slower with it).
    disable_overlap_schedule: bool | None = None
    # A prefill batch's forward also steps the running requests (one token each), as vLLM's
    # scheduler always does: a stream's next token never waits behind another's prompt. Off
    # by default (as in SGLang): the decode rows go through the prefill attention kernels,
    # which on an H200 cost more than their own decode step (benchmarks/RESULTS.md 2026-12-04).
    enable_mixed_chunk: bool = False
    attention_backend: Literal["auto", "torch", "flashinfer"] = "auto"
    skip_tokenizer_init: bool = False
    # Threads of the tokenizer's process (the detokenizer's) that encode prompts and render
    # chat templates for the caller's side, whose process loads no tokenizer.
    tokenizer_threads: int = 4
    cuda_graph_max_bs: int = 256
    # Batches the decode graphs do not take (prefill chunks, decode past cuda_graph_max_bs) of up
    # to this many tokens replay CUDA graphs of everything but attention (sgl.sched.runner.prefill_graph); 0: eager.
    piecewise_cuda_graph_max_tokens: int = 2048
    disable_cuda_graph: bool = False
    # Decode batches sharing a long prefix read it once per step, under CUDA graphs too.
    # None: on where the backend reads the prefix once (flashinfer: W3 4.3x faster than
    # radix off on an H200, benchmarks/RESULTS.md), off for the torch backend, whose
    # cascade is a reference that gathers the prefix per request anyway.
    enable_cascade_attention: bool | None = None
    # With decode_attention_backend="flashinfer": FlashInfer's tensor-core decode kernel (its
    # prefill kernel, which balances mixed contexts over the SMs) for decode batches of at
    # least this many rows; models whose query heads share a KV head four or more ways use it
    # at every size.
    tensor_core_decode_min_batch: int = 48
    # The kernel of plain decode batches under attention_backend="flashinfer": sgl's Triton
    # kernel (sgl.kernels.triton_decode: as fast as FlashInfer's best pick on a bf16 cache,
    # 15-20% faster on an FP8 one, and no plan on the host), or FlashInfer's own (its two
    # kernels, tensor_core_decode_min_batch). auto: triton where Triton is installed.
    decode_attention_backend: Literal["auto", "triton", "flashinfer"] = "auto"
    # The KV cache's element type: "auto" (the model's dtype), or FP8 (SGLang's names), which
    # halves the bytes a decode step reads against bf16 and doubles the tokens that fit;
    # stored unscaled (values past the type's range are clamped to it).
    kv_cache_dtype: Literal["auto", "fp8_e4m3", "fp8_e5m2"] = "auto"
    # Weights: "fp8" (SGLang's and vLLM's name) quantizes the decoder layers' projections
    # to FP8 as they load, a scale per output channel, activations per token at each call
    # (sgl.kernels.fp8_linear); embeddings, norms and the LM head stay in the model's dtype.
    # None: "fp8" for a checkpoint stored in FP8 on a GPU that runs FP8 GEMMs, else none.
    quantization: Literal["fp8"] | None = None
    max_top_logprobs_num: int = 20  # the most top logprobs a request may ask for per token (OpenAI's bound)
    # Names (registered) or dotted paths (pkg.mod:Class) of logit processors requests may use.
    custom_logit_processors: list[str] = []
    # Structured output (json_schema, regex, ebnf): xgrammar, or "none" to refuse it.
    grammar_backend: Literal["xgrammar", "none"] = "xgrammar"

    # Tensor parallelism: one scheduler process per rank over torch.distributed (NCCL on
    # GPUs, rank r on cuda:r; gloo on CPU), rank 0 receiving requests and broadcasting
    # them so every rank schedules the same batches. Needs processes (not inproc).
    tp_size: int = 1
    # Where the ranks meet (host:port); None: a free port on 127.0.0.1 (one node).
    dist_init_addr: str | None = None
    # Data parallelism: replicas of the whole scheduler (each of tp_size ranks; on GPU the
    # ranks of replica k on GPUs k x tp_size onward) behind one tokenizer manager, which
    # routes each request by prefix affinity, then load (sgl/runtime/dp_router.py).
    dp_size: int = 1

    random_seed: int | None = None
    log_level: Literal["debug", "info", "warning", "error"] = "warning"
    watchdog_interval: float = 0.5  # seconds between child liveness checks
    # Seconds a control call (flush_cache, get_server_info) and a health check wait for
    # their reply before raising TimeoutError (the scheduler answers between batches).
    control_timeout: float = 30.0
    health_timeout: float = 10.0

    def __post_init__(self) -> None:
        _positive(self, "max_total_tokens", "context_length", "max_running_requests", "cuda_graph_max_bs",
                  "tensor_core_decode_min_batch",
                  "max_top_logprobs_num", "max_queued_requests", "max_lora_rank", "max_loras_per_batch",
                  "max_loaded_loras", "speculative_ngram_min_match_window_size",
                  "speculative_disable_by_batch_size")
        if not 2 <= self.speculative_num_draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"speculative_num_draft_tokens={self.speculative_num_draft_tokens} is invalid: must be "
                             f"in [2, {MAX_DRAFT_TOKENS}] (the last token and at least one proposed one)")
        drafted = self.speculative_algorithm == "STANDALONE"
        if drafted != (self.speculative_draft_model_path is not None):
            raise ValueError("speculative_draft_model_path is invalid without speculative_algorithm='STANDALONE'"
                             if not drafted else "speculative_algorithm='STANDALONE' needs "
                             "speculative_draft_model_path: a Hugging Face model directory of the same tokenizer")
        if drafted and self.tp_size > 1:
            raise ValueError("speculative_algorithm='STANDALONE' is invalid with tp_size > 1: the draft model runs "
                             "on one device; use NGRAM, or tp_size=1")
        lo, hi = self.speculative_ngram_min_match_window_size, self.speculative_ngram_max_match_window_size
        if not lo <= hi <= MAX_NGRAM_WINDOW:
            raise ValueError(f"speculative_ngram_max_match_window_size={hi} is invalid: must be in "
                             f"[speculative_ngram_min_match_window_size ({lo}), {MAX_NGRAM_WINDOW}]")
        if self.piecewise_cuda_graph_max_tokens < 0:
            raise ValueError(f"piecewise_cuda_graph_max_tokens={self.piecewise_cuda_graph_max_tokens} is invalid: "
                             "must be 0 (no piecewise graphs) or more")
        if self.max_lora_rank is not None and self.max_lora_rank > MAX_LORA_RANK:
            raise ValueError(f"max_lora_rank={self.max_lora_rank} is invalid: must be at most {MAX_LORA_RANK}")
        adapters = self.lora_adapters  # checks the entries
        if self.enable_lora is False and adapters:
            raise ValueError("lora_paths is invalid with enable_lora=False: drop one of them")
        if len(adapters) > self.max_loaded_loras:
            raise ValueError(f"lora_paths names {len(adapters)} adapters, more than max_loaded_loras="
                             f"{self.max_loaded_loras}")
        if not 1 <= self.tokenizer_threads <= 64:
            raise ValueError(f"tokenizer_threads={self.tokenizer_threads} is invalid: must be in [1, 64]")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size < 1 and self.chunked_prefill_size != -1:
            raise ValueError(f"chunked_prefill_size={self.chunked_prefill_size} is invalid: must be >= 1, -1 for no "
                             "chunking, or None for the default")
        for name in ("control_timeout", "health_timeout", "watchdog_interval"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} is invalid: must be > 0 seconds")
        if self.request_timeout is not None and not 0 < self.request_timeout <= MAX_TIMEOUT_S:
            raise ValueError(f"request_timeout={self.request_timeout} is invalid: must be in (0, {MAX_TIMEOUT_S:g}] "
                             "seconds, or None for no deadline")
        if self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens={self.max_prefill_tokens} is invalid: must be >= 1")
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"mem_fraction_static={self.mem_fraction_static} is invalid: must be in (0, 1)")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port={self.port} is invalid: must be in [0, 65535]")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes={self.max_request_bytes} is invalid: must be >= 1")
        for name in ("api_key", "admin_api_key"):
            if getattr(self, name) is not None and not getattr(self, name):
                raise ValueError(f"{name} is invalid: must be a non-empty string (or None for no key)")
        if self.transport_key is not None:
            try:
                key = bytes.fromhex(self.transport_key)
            except ValueError:
                raise ValueError("transport_key is invalid: must be a hex string") from None
            if len(key) < 16:
                raise ValueError("transport_key is invalid: must hold at least 16 bytes (32 hex digits)")
        if self.transport_keys is not None and self.transport_key is not None:
            raise ValueError("transport_keys and transport_key are invalid together: give CURVE keys (a folder) or "
                             "a shared HMAC key, not both")
        if self.tp_size < 1 or self.dp_size < 1:
            raise ValueError(f"tp_size={self.tp_size}, dp_size={self.dp_size} are invalid: each must be >= 1")
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) + self.dp_size - 1 <= 65535:
                raise ValueError(f"dist_init_addr={self.dist_init_addr!r} is invalid: must be host:port "
                                 "(replica k's ranks meet at port + k)")
        if self.tp_size > 1 and self.transport == "inproc":
            raise ValueError(f"tp_size={self.tp_size} needs one process per rank: use transport='ipc' or 'tcp', "
                             "not 'inproc'")
        if self.watchdog_interval <= 0:
            raise ValueError(f"watchdog_interval={self.watchdog_interval} is invalid: must be > 0")
        if self.reasoning_parser == "generic" and (len(self.reasoning_markers) != 2 or not all(self.reasoning_markers)):
            raise ValueError(f"reasoning_markers={self.reasoning_markers} is invalid: reasoning_parser='generic' needs "
                             "two non-empty markers, the start and the end of the reasoning")
        if self.reasoning_markers and self.reasoning_parser != "generic":
            raise ValueError("reasoning_markers is invalid without reasoning_parser='generic' (the other parsers "
                             "know their markers)")

    @property
    def lora_adapters(self) -> dict[str, str]:
        """lora_paths as {name: path}: "name=path", or a path named by its last folder.
        The one place those entries are read; a bad entry is a ValueError naming it."""
        out: dict[str, str] = {}
        for entry in self.lora_paths:
            name, sep, path = entry.partition("=")
            if not sep:
                path = entry
                name = entry.rstrip("/").rsplit("/", 1)[-1]
            if not name or not path or not LORA_NAME.fullmatch(name):
                raise ValueError(f"lora_paths entry {entry!r} is invalid: give name=path (a name of {LORA_NAME_RULE}) "
                                 "or a path")
            if name in out:
                raise ValueError(f"lora_paths names the adapter {name!r} twice")
            out[name] = path
        return out

    @property
    def lora_enabled(self) -> bool:
        """Whether the engine serves LoRA adapters (enable_lora, or lora_paths given)."""
        return bool(self.enable_lora) or (self.enable_lora is None and bool(self.lora_paths))

    def model_files(self, model_path: str) -> ModelFiles:
        """The files these args name once the model is found at `model_path` (model_path
        itself, or the default model's when it is None): the tokenizer is the model's own
        unless tokenizer_path names another. The one place that default is decided."""
        return ModelFiles(model_path, self.tokenizer_path or model_path)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ServerArgs:
        """Build from keyword arguments; a wrong name or type is a ValueError naming it."""
        try:
            return msgspec.convert(kwargs, cls, strict=True)
        except msgspec.ValidationError as e:
            raise ValueError(f"server args: {e}") from None


SECRET_FIELDS = ("api_key", "admin_api_key", "transport_key")


def redacted(args: ServerArgs) -> dict[str, Any]:
    """The args as a dict with secrets hidden (what /get_server_info shows)."""
    out = msgspec.structs.asdict(args)
    for name in SECRET_FIELDS:
        if out[name] is not None:
            out[name] = "<redacted>"
    return out


def _positive(args: ServerArgs, *names: str) -> None:
    for name in names:
        v = getattr(args, name)
        if v is not None and v < 1:
            raise ValueError(f"{name}={v} is invalid: must be >= 1 (or None for the default)")
