"""`FakeEngine`: `sgl.AsyncEngine`'s public surface with no model, for testing apps that
embed sgl without a GPU, weights or torch; `FakeSyncEngine` is its `sgl.Engine` twin.

Everything but the model is the engine's own code: the front end both engines share,
the tokenizer manager (argument checks and their ValueErrors, rids, n samples, stream
fan-out, meta_info, logprob formatting, errors), the detokenizer (incremental text,
stop-string hold-back and trimming, beams' texts) and the wire codec between them. Only
the scheduler is scripted (`ScriptedScheduler`): a request's output is its responder's
text (or ids), tokenized and ended by the scheduler's rules (max_new_tokens and
min_new_tokens, stop ids and EOS, stop strings through the scheduler's own matcher, the
context length, grammars), sent one token per step on the loop's clock with simulated
latency, under the faults of a `FaultPlan` (sgl/core/faults.py).

Time is the event loop's. On a virtual-time loop (`VirtualTimeLoop`, `run_virtual`)
latencies and timeouts pass without real waiting; the fake runs no thread, so virtual
time never jumps past work in flight.

It imports no torch: its tokenizer is a `tokenizers` one (a model directory's
tokenizer.json, or a byte-level one built in), and a chat renders through transformers'
template renderer, which needs none. Only a grammar request that needs xgrammar (an
ebnf, or a json_schema or regex its responder's text does not match) imports xgrammar,
and torch with it."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import json
import os
import selectors
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from sgl.core.faults import FaultPlan
from sgl.core.protocol import (
    BatchTokenIDOutput,
    Message,
    TokenizerCall,
    TokenizerCallOutput,
)
from sgl.core.request_checks import limits_of
from sgl.core.sampling_params import SamplingParams
from sgl.core.server_args import ServerArgs
from sgl.engine.front_end import EngineFrontEnd
from sgl.engine.sync_engine import Engine
from sgl.runtime.detokenizer import Detokenizer
from sgl.runtime.metrics import Metrics
from sgl.runtime.tokenizer_manager import EngineDeadError, TokenizerManager
from sgl.runtime.tokenizer_ops import run_call
from sgl.sched.models.tokenizer import load_chat_template
from sgl.testing.scripted import Latency, ModelFacts, Output, ScriptedScheduler, call_on_loop
from sgl.transports.channel import ChannelClosed, Receiver, Sender
from sgl.transports.codec import Codec

T = TypeVar("T")
DEFAULT_TEXT = "This is a fake answer."
BUILTIN_MODEL = "sgl-fake-bytes"  # the model_path of an engine on the built-in tokenizer
BUILTIN_CONTEXT = 4096
DEFAULT_KV_SLOTS = 65536
DEFAULT_RUNNING = 256
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


# ---- the tokenizer -------------------------------------------------------------------


class FakeTokenizer:
    """A `tokenizers.Tokenizer` with the Hugging Face tokenizer methods sgl's roles call
    (the detokenizer, the tokenizer manager's ops, stop strings), so that neither
    transformers' tokenizer classes nor torch load. Decoding is the backend's own."""

    clean_up_tokenization_spaces = False

    def __init__(self, backend: Tokenizer, eos_ids: list[int], special_tokens: dict[str, str],
                 chat_template: str | None) -> None:
        self._tokenizer = backend  # the detokenizer's fast path steps it with DecodeStream
        self.eos_ids = eos_ids
        self.special_tokens_map = special_tokens
        self.chat_template = chat_template
        added = backend.get_added_tokens_decoder()
        self.all_special_ids = sorted(i for i, t in added.items() if t.special)

    @classmethod
    def from_dir(cls, path: str, chat_template: str | None = None) -> FakeTokenizer:
        """A model directory's tokenizer.json, with its tokenizer_config.json's special
        tokens and chat template and its model's EOS ids (config and generation config)."""
        if not os.path.isfile(os.path.join(path, "tokenizer.json")):
            raise ValueError(f"model_path={path!r} is invalid: a FakeEngine reads a model directory's tokenizer.json")
        cfg, tmpl = _json(path, "tokenizer_config.json"), os.path.join(path, "chat_template.jinja")
        special = {k: v["content"] if isinstance(v, dict) else v for k, v in cfg.items()
                   if k in ("bos_token", "eos_token", "unk_token", "pad_token") and v}
        template = chat_template or cfg.get("chat_template") or (tmpl if os.path.isfile(tmpl) else None)
        eos: set[int] = set()
        for name in ("config.json", "generation_config.json"):
            e = _json(path, name).get("eos_token_id")
            eos.update([e] if isinstance(e, int) else e or [])
        return cls(Tokenizer.from_file(os.path.join(path, "tokenizer.json")), sorted(eos), special,
                   load_chat_template(template) if template else None)

    @classmethod
    def byte_level(cls, chat_template: str | None = None) -> FakeTokenizer:
        """The built-in tokenizer: one token per UTF-8 byte (id = the byte's value), then
        256 `<|im_start|>` and 257 `<|im_end|>` (EOS), with a ChatML template."""
        bs = [*range(33, 127), *range(161, 173), *range(174, 256)]  # GPT-2's printable stand-ins for bytes
        stand_in = dict(zip(bs, bs))
        stand_in.update({b: 256 + k for k, b in enumerate(b for b in range(256) if b not in stand_in)})
        backend = Tokenizer(models.BPE(vocab={chr(stand_in[b]): b for b in range(256)}, merges=[]))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)])
        return cls(backend, [257], {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"},
                   load_chat_template(chat_template) if chat_template else CHATML)

    def __len__(self) -> int:
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    def __call__(self, texts: list[str], add_special_tokens: bool = True) -> dict[str, list[list[int]]]:
        encodings = self._tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)
        return {"input_ids": [e.ids for e in encodings]}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = False, spaces_between_special_tokens: bool = True,
               **_: Any) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def batch_decode(self, ids: list[list[int]], skip_special_tokens: bool = False) -> list[str]:
        return list(self._tokenizer.decode_batch(ids, skip_special_tokens=skip_special_tokens))

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self._tokenizer.id_to_token(i) or "" for i in ids]

    def get_vocab(self) -> dict[str, int]:
        return dict(self._tokenizer.get_vocab(with_added_tokens=True))

    def apply_chat_template(self, conversation: list[dict[str, Any]], tokenize: bool = False,
                            add_generation_prompt: bool = False, continue_final_message: bool = False,
                            tools: list[dict[str, Any]] | None = None, **kwargs: Any) -> str:
        """The conversation through the chat template, by transformers' renderer (it imports no torch)."""
        from transformers.utils.chat_template_utils import render_jinja_template

        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        render: Any = render_jinja_template  # it returns (texts, generation indices), not as annotated
        texts, _ = render(conversations=[conversation], tools=tools, chat_template=self.chat_template,
                          continue_final_message=continue_final_message, add_generation_prompt=add_generation_prompt,
                          **{**self.special_tokens_map, **kwargs})
        return str(texts[0])


def _json(folder: str, name: str) -> dict[str, Any]:
    try:
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


class InlineTokenizing:
    """The tokenizer manager's tokenizer, worked on the loop itself: a fake engine's
    calls take microseconds, and no thread may run behind a virtual clock's back."""

    def __init__(self, tokenizer: FakeTokenizer) -> None:
        self.tokenizer = tokenizer
        self.has_chat_template = bool(tokenizer.chat_template)
        self.vocab: list[str] | None = None
        self.vocab_loading: asyncio.Future[TokenizerCallOutput] | None = None
        self.guard: Callable[[], None] = lambda: None

    async def call(self, call: TokenizerCall) -> TokenizerCallOutput:
        self.guard()
        return run_call(self.tokenizer, call)

    def reply(self, msg: Message) -> None:
        pass

    def fail(self, error: BaseException) -> None:
        pass

    def close(self) -> None:
        pass


class LoopTokenizerManager(TokenizerManager):
    """The engine's tokenizer manager, formatting large logprob batches on the loop (no thread)."""

    async def run_sync(self, fn: Callable[..., T], *args: Any) -> T:
        return fn(*args)


# ---- the responder ---------------------------------------------------------------------

# A text, a list of texts (cycled), a mapping from prompt to text, or (prompt, sampling_params) -> text;
# token ids in place of a text are the output's tokens as they are.
Responder = str | Sequence[str] | Mapping[str, Output] | Callable[[str, SamplingParams], Output]


class Responses:
    """A responder as one call: (prompt, params) -> the output's text or token ids."""

    def __init__(self, responder: Responder) -> None:
        self.responder = responder
        self._cycle = itertools.cycle([responder] if isinstance(responder, str) else list(responder)) \
            if isinstance(responder, (str, Sequence)) else None

    def __call__(self, prompt: str, params: SamplingParams) -> Output:
        if self._cycle is not None:
            return next(self._cycle)
        if isinstance(self.responder, Mapping):
            if prompt not in self.responder:
                raise KeyError(f"no response for the prompt {prompt!r}")
            return self.responder[prompt]
        assert callable(self.responder)
        return self.responder(prompt, params)


# ---- the channels ----------------------------------------------------------------------


class LoopPipe(Sender, Receiver):
    """One direction between two parts of a fake engine on one event loop. Each message
    crosses the wire codec, as over the in-process transport; `close` may come from any thread."""

    def __init__(self, on_send: Callable[[], None] | None = None) -> None:
        self.on_send = on_send
        self.closed = False
        self._codec = Codec()
        self._items: deque[Message] = deque()
        self._ready = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    def send(self, msg: Message) -> None:
        if self.closed:
            return
        self._items.append(self._codec.decode(self._codec.encode(msg)))
        self._ready.set()
        if self.on_send is not None:
            self.on_send()

    def recv(self, timeout: float | None = None) -> Message | None:
        return self._items.popleft() if self._items else None

    async def recv_async(self) -> Message:
        while not self._items:
            if self.closed:
                raise ChannelClosed("the fake engine's channel was closed")
            await self.wait(None)
        return self._items.popleft()

    async def wait(self, timeout: float | None) -> None:
        """Until a message waits or the pipe closes, or `timeout` seconds of loop time pass."""
        self._loop = asyncio.get_running_loop()
        if self._items or self.closed:
            return
        self._ready.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._ready.wait(), timeout)

    def close(self) -> None:
        self.closed = True
        if self._loop is not None:
            call_on_loop(self._loop, self._ready.set)


class DetokenizerStage(Sender):
    """The scheduler's sender: token outputs go through the real detokenizer, control
    replies pass, as the detokenizer role passes them on to the tokenizer manager."""

    def __init__(self, detokenizer: Detokenizer, to_manager: LoopPipe) -> None:
        self.detokenizer = detokenizer
        self.to_manager = to_manager
        self._codec = Codec()

    def send(self, msg: Message) -> None:
        msg = self._codec.decode(self._codec.encode(msg))
        self.to_manager.send(self.detokenizer.process(msg) if isinstance(msg, BatchTokenIDOutput) else msg)

    def close(self) -> None:
        pass


# ---- the engines -----------------------------------------------------------------------


class FakeEngine(EngineFrontEnd):
    """`async with FakeEngine(["Paris."]) as e: out = await e.generate("Capital of France?")`.

    The surface of `sgl.AsyncEngine` (the same front end), with its output from
    `responder`: a text, a list of texts (cycled, one per request or sample), a mapping
    from prompt to text, or a callable (prompt, SamplingParams) -> text; a list of
    token ids in place of a text is taken as the output's tokens. A beam request asks
    it once per beam. Sampling (temperature, penalties, logit processors) changes
    nothing: the responder decides, and n samples each ask it (sample i with seed + i).

    `model_path`: a model directory whose tokenizer.json (special tokens, chat template,
    EOS ids, generation config, context length and vocabulary) the fake uses; None:
    the built-in byte-level tokenizer. `faults`: the FaultPlan it obeys (`engine.faults`,
    which may grow while it runs). `first_token_s`, `per_token_s`: latency on the
    loop's clock. Other keyword arguments are `sgl.ServerArgs` (context_length,
    max_total_tokens, max_running_requests, max_queued_requests, max_top_logprobs_num,
    control_timeout, health_timeout, custom_logit_processors, skip_tokenizer_init,
    chat_template ...)."""

    def __init__(self, responder: Responder = DEFAULT_TEXT, *, model_path: str | None = None,
                 faults: FaultPlan | None = None, first_token_s: float = 0.0, per_token_s: float = 0.0,
                 **server_args: Any) -> None:
        args = ServerArgs.from_kwargs(model_path=model_path or BUILTIN_MODEL, transport="inproc", **server_args)
        path = args.tokenizer_path or model_path
        tok = FakeTokenizer.from_dir(path, args.chat_template) if path else FakeTokenizer.byte_level(args.chat_template)
        config = _json(model_path, "config.json") if model_path else {}
        kv = args.max_total_tokens or DEFAULT_KV_SLOTS
        model = ModelFacts(max(int(config.get("vocab_size", 0)), len(tok)),
                           args.context_length or int(config.get("max_position_embeddings", BUILTIN_CONTEXT)),
                           tok.eos_ids, kv, args.max_running_requests or DEFAULT_RUNNING)
        self.faults = faults if faults is not None else FaultPlan()
        to_scheduler, to_manager = LoopPipe(), LoopPipe()
        detokenizer = Detokenizer(None if args.skip_tokenizer_init else tok, to_scheduler, to_manager)
        self.scheduler = ScriptedScheduler(args, tok, model, Responses(responder), self.faults,
                                           Latency(first_token_s, per_token_s), to_scheduler,
                                           DetokenizerStage(detokenizer, to_manager), self._died)
        to_scheduler.on_send = self.scheduler.start
        self._tokenizer = None if args.skip_tokenizer_init else tok
        tokenizing = None if self._tokenizer is None else InlineTokenizing(tok)
        metrics = Metrics()
        info = self.scheduler.info()
        tm = LoopTokenizerManager(tokenizing, to_scheduler, to_manager,
                                  limits_of(info, tokenizing is not None, args.custom_logit_processors), model_path,
                                  metrics=metrics, control_timeout=args.control_timeout,
                                  health_timeout=args.health_timeout)
        super().__init__(args, args.model_files(model_path or BUILTIN_MODEL), info, tm, metrics)

    @classmethod
    async def start(cls, responder: Responder = DEFAULT_TEXT, **options: Any) -> FakeEngine:
        """The fake engine (as `AsyncEngine.start`, awaitable; nothing blocks)."""
        return cls(responder, **options)

    @property
    def tokenizer(self) -> Any:
        """The fake's tokenizer, with the Hugging Face methods sgl uses (None under skip_tokenizer_init)."""
        return self._tokenizer

    def _died(self, message: str) -> None:
        self.tm.fail_all(EngineDeadError(message))

    def _stop(self) -> None:
        self.scheduler.stop()

    async def aclose(self) -> None:
        """Shut down; nothing waits on a thread (a fake has no roles to wait for)."""
        await self.tm.close()
        self.shutdown()


class FakeSyncEngine(Engine):
    """`sgl.Engine`'s twin over a FakeEngine: the same blocking calls, the fake's loop on
    a private thread; `virtual_time=True` runs that loop on virtual time. Arguments as
    for FakeEngine."""

    def __init__(self, responder: Responder = DEFAULT_TEXT, *, virtual_time: bool = False, **options: Any) -> None:
        self._loop = VirtualTimeLoop() if virtual_time else asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sgl-fake-engine-loop", daemon=True)
        self._thread.start()
        self._closed = False
        try:
            fake = FakeEngine(responder, **options)
        except BaseException:
            self._stop_loop()
            raise
        self._engine = fake  # type: ignore[assignment]  # Engine's calls are the front end's, which it has
        self.faults = fake.faults
        atexit.register(self.shutdown)


# ---- virtual time ----------------------------------------------------------------------


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An asyncio event loop on virtual time: when nothing is ready to run, no I/O has
    come in and no executor job (`run_in_executor`, `asyncio.to_thread`) is out, its
    clock jumps to the next timer instead of sleeping, so sleeps, timeouts and a fake
    engine's latency pass at once and in their order. While an executor job is out it
    waits in real time, its clock following. Threads it is not told of (anyio's, plain
    ones) are not waited for: code on virtual time keeps its blocking work in executors."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start
        self.jobs = 0
        super().__init__(_JumpingSelector(self))

    def time(self) -> float:
        return self.now

    def run_in_executor(self, executor: Any, func: Callable[..., T], *args: Any) -> asyncio.Future[T]:  # type: ignore[override]
        fut = super().run_in_executor(executor, func, *args)
        self.jobs += 1
        fut.add_done_callback(self._job_done)
        return fut

    def _job_done(self, _: object) -> None:
        self.jobs -= 1


class _JumpingSelector(selectors.DefaultSelector):
    """The loop's selector: a wait for a timer becomes a jump of the loop's clock."""

    def __init__(self, loop: VirtualTimeLoop) -> None:
        super().__init__()
        self.loop = loop

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready: list[tuple[selectors.SelectorKey, int]] = super().select(0)
        if ready or (timeout is not None and timeout <= 0):
            return ready
        if timeout is not None and not self.loop.jobs:
            self.loop.now += timeout  # nothing can happen before the next timer: it is due now
            return []
        started = time.monotonic()
        ready = super().select(timeout)
        if timeout is not None:
            self.loop.now += min(timeout, time.monotonic() - started)
        return ready


def run_virtual(main: Awaitable[T], start: float = 0.0) -> T:
    """`asyncio.run(main)` on virtual time: the tasks it leaves are cancelled."""
    loop = VirtualTimeLoop(start)
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(main)
    finally:
        tasks = asyncio.all_tasks(loop)
        for t in tasks:
            t.cancel()
        if tasks:
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        asyncio.set_event_loop(None)
        loop.close()
