"""The help text of every ServerArgs field, as `sgl serve --help` shows it (the
flag's default is appended there). Data only: a new ServerArgs field needs a line
here (tests/test_cli_args.py checks that each field has one). Bottom layer:
imports nothing of sgl."""

from __future__ import annotations

FIELD_HELP: dict[str, str] = {
    "enable_lora": "serve LoRA adapters (on when --lora-paths names any; give it to load adapters only at run "
                   "time)",
    "lora_paths": "LoRA adapters (PEFT folders) loaded at start, as NAME=PATH or PATH (named by its folder)",
    "max_lora_rank": "the largest LoRA rank adapters may have; default: the largest of --lora-paths, else 16",
    "lora_target_modules": "the projections LoRA adapters may change (q_proj k_proj v_proj o_proj gate_proj up_proj "
                           "down_proj, or all); default: all",
    "max_loras_per_batch": "LoRA adapters on the device at once, so in one batch (others wait, or are loaded "
                           "in place of unused ones)",
    "max_loaded_loras": "LoRA adapters held in host memory at once (loads past it are refused)",
    "speculative_algorithm": "speculative decoding: NGRAM proposes tokens from each request's own prompt and output, "
                             "STANDALONE from a draft model (--speculative-draft-model-path); verified in one "
                             "forward (same outputs, fewer steps); unset: off",
    "speculative_draft_model_path": "STANDALONE: the draft model, a Hugging Face directory of a smaller model with "
                                    "the same tokenizer",
    "speculative_num_draft_tokens": "tokens a speculative step verifies per request: its last token and up to N-1 "
                                    "proposed ones",
    "speculative_ngram_min_match_window_size": "NGRAM: the shortest suffix of a request's tokens matched earlier "
                                               "in them",
    "speculative_ngram_max_match_window_size": "NGRAM: the longest suffix matched (longer ones are tried first)",
    "speculative_disable_by_batch_size": "speculate only while at most N requests run; above it, plain decode steps "
                                         "under the overlap loop (default: always)",
    "model_path": "Hugging Face model directory or .gguf file (also the positional MODEL of `sgl serve`); "
                  "unset: the default model, SmolLM2-135M-Instruct",
    "tokenizer_path": "tokenizer directory, if not the model's",
    "load_format": "how to read the weights: auto (by the path), safetensors, gguf, dummy (random weights) or "
                   "null (instant fake logits, for pipeline tests)",
    "dtype": "weight and activation dtype; auto: bfloat16 on CUDA, float32 on CPU",
    "device": "where the model runs; auto: CUDA when available",
    "trust_remote_code": "allow a tokenizer's custom code from the model directory",
    "context_length": "the longest prompt plus output a request may have (default: the model's)",
    "transport": "how the roles talk: inproc (threads of one process), ipc (unix sockets) or tcp",
    "host": "the HTTP server's address (and the tcp transport's)",
    "port": "the HTTP server's port; 0 picks a free one",
    "api_key": "Bearer token every HTTP path but /health needs",
    "admin_api_key": "Bearer token the control routes need instead of the api key (pause and continue, weight "
                     "updates, memory release and resume, flush_cache, abort_all); unset: the api key",
    "transport_key": "tcp transport: a shared HMAC secret (hex, >= 32 digits; the legacy mode)",
    "transport_keys": "tcp transport: a CURVE key folder made by `sgl keys new DIR`",
    "served_model_name": "the model's name in the OpenAI API (/v1/models, the `model` field of requests and "
                         "responses); default: the model directory's name",
    "max_request_bytes": "the largest HTTP request body accepted (a 413 past it)",
    "chat_template": "a Jinja chat template, or a file holding one, used instead of the tokenizer's",
    "allow_origins": "CORS: the origins browsers may call the HTTP server from ('*': any); none by default",
    "incremental_streaming_output": "native /generate streams send only the new text and ids in each chunk "
                                    "(default: everything so far, as SGLang does)",
    "tool_call_parser": "how the model writes tool calls, read out of its text for OpenAI tool_choice auto: "
                        "hermes (<tool_call> JSON blocks; qwen and qwen25 are its aliases), llama3 (a JSON "
                        "message; alias llama3_json), mistral ([TOOL_CALLS] and a JSON list) or pythonic (a list "
                        "of Python calls, as Llama 3.2 and 4 write them); unset: the text stays content",
    "reasoning_parser": "how a reasoning model marks its thinking, given apart as reasoning_content in chat "
                        "completions: qwen3 (<think>...</think>; chat_template_kwargs enable_thinking=false: no "
                        "reasoning), deepseek-r1 (reasoning from the first token to </think>) or generic (the "
                        "--reasoning-markers); unset: the thinking stays content",
    "reasoning_markers": "with --reasoning-parser generic: the start and the end marker of the reasoning, e.g. "
                         "'<think>' '</think>'",
    "max_total_tokens": "KV cache slots (default: sized from free memory)",
    "mem_fraction_static": "fraction of GPU memory for weights plus the KV cache (default 0.8)",
    "max_running_requests": "the most requests decoding at once (default: from the KV pool)",
    "max_prefill_tokens": "the most prompt tokens admitted in one prefill round",
    "chunked_prefill_size": "prompt tokens per prefill forward; -1: no chunking (default: by device memory, "
                            "8192 on an H100, 16384 on an H200, 2048 on CPU)",
    "max_queued_requests": "waiting requests past which a new one is refused with a 503",
    "schedule_policy": "admission order: fcfs (arrival), lpm (longest cached prefix first) or priority (the "
                       "request's priority, higher first; lower-priority running requests retracted for room)",
    "request_timeout": "seconds from receipt within which a request without its own timeout must finish, else "
                       "it is aborted (default: no deadline)",
    "disable_radix_cache": "do not reuse the KV of shared prompt prefixes",
    "is_embedding": "serve embeddings (encode, /v1/embeddings) with a model that has no sentence-transformers "
                    "modules.json: last-token pooling, normalised (a model with one is recognised without it)",
    "pooling": "how embeddings pool the prompt's final hidden states: last (token), mean, or auto (as the "
               "model's sentence-transformers files say; last without them)",
    "disable_overlap_schedule": "run the scheduler and the forward in turn (default: overlapped on CUDA only)",
    "enable_mixed_chunk": "a prefill's forward also takes the running requests' next tokens (default: off, "
                          "prefills and decode steps run as separate forwards)",
    "attention_backend": "attention kernels: torch (reference) or flashinfer; auto: flashinfer on CUDA",
    "skip_tokenizer_init": "load no tokenizer: requests send and receive token ids only",
    "tokenizer_threads": "threads of the tokenizer's process (the detokenizer's) that encode prompts and render "
                         "chat templates",
    "cuda_graph_max_bs": "the largest decode batch captured in a CUDA graph",
    "piecewise_cuda_graph_max_tokens": "prefill batches of up to this many tokens replay CUDA graphs of "
                                       "everything but attention; 0: eager",
    "disable_cuda_graph": "run without CUDA graphs (decode and piecewise prefill)",
    "tensor_core_decode_min_batch": "with FlashInfer's decode: batches of at least this many rows may use its "
                                    "tensor-core kernel (always when 4+ query heads share a KV head)",
    "decode_attention_backend": "plain decode's kernel with flashinfer: triton (sgl's) or flashinfer; auto: "
                                "triton where Triton is installed",
    "kv_cache_dtype": "the KV cache's element type: auto (the model's dtype), fp8_e4m3 or fp8_e5m2 (half the "
                      "bytes of bf16: twice the tokens, faster decode; unscaled, so slightly less exact)",
    "quantization": "fp8: the decoder's projection weights in FP8 (half their bytes; a scale per output "
                    "channel, activations scaled per token), quantized as they load; GPUs of compute capability 8.9+",
    "enable_cascade_attention": "read a decode batch's shared prefix once per step (default: on with flashinfer)",
    "max_top_logprobs_num": "the most top logprobs a request may ask for per token",
    "custom_logit_processors": "logit processors requests may use: registered names or pkg.mod:Class paths",
    "grammar_backend": "structured output (json_schema, regex, ebnf): xgrammar, or none to refuse it",
    "tp_size": "tensor parallelism: scheduler processes (GPUs) the model is split over",
    "dist_init_addr": "host:port where the tensor-parallel ranks meet (default: a free local port)",
    "dp_size": "data parallelism: scheduler replicas behind one front end, routed by prefix and load",
    "random_seed": "the sampler's seed; unset: a random one for each `sgl serve` (as SGLang), "
                   "0 in the engines",
    "log_level": "log level of sgl's loggers and uvicorn's",
    "watchdog_interval": "seconds between checks that the child roles are alive",
    "control_timeout": "seconds a control call (flush_cache, get_server_info) waits for its reply",
    "health_timeout": "seconds a health check waits for the scheduler's reply",
}
