"""The tokenizer manager's tokenizer: async calls whose work runs elsewhere, so the
caller's loop (and, for an engine's own roles, the caller's process) never holds a
tokenizer's GIL-bound work.

- `RemoteTokenizer`: the engine's own. The tokenizer lives in the detokenizer's
  process (loading one holds the GIL for its whole parse: ~0.2 s for a 3.5 MB
  tokenizer.json, which no thread of the caller's could hide); each call is a
  TokenizerCall sent there, matched to its reply by req_id (sgl.runtime.control).
- `LocalTokenizer`: a tokenizer loaded in this process (an engine attached from
  another process has no roles of its own), worked on this client's threads.

Both run the same `sgl.runtime.tokenizer_ops.run_call`; errors come back as
ValueErrors in the caller's terms. Logprob texts come from `vocab_texts`, fetched
once (before the first request that asks for them) and then read on the loop.
It must not decide anything about requests: it only turns text into ids and back."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

import anyio
import anyio.to_thread

from sgl.core.protocol import Message, TokenizerCall, TokenizerCallOutput
from sgl.runtime.control import ControlCalls
from sgl.runtime.tokenizer_ops import run_call
from sgl.transports.channel import Sender
from sgl.transports.codec import MAX_FRAME_BYTES

CALL_TIMEOUT_S = 60.0  # a call is ms of work; only a stuck tokenizer process reaches this
MAX_TEXT_BYTES = MAX_FRAME_BYTES // 2  # what one call may carry (UTF-8): the frame bound, with room


def _no_guard() -> None:
    pass


class Tokenizing(Protocol):
    has_chat_template: bool
    vocab: list[str] | None  # each id's text, once `load_vocab` ran
    vocab_loading: asyncio.Future[TokenizerCallOutput] | None
    # Called before each call, on the loop: the tokenizer manager starts its receive loop
    # (where replies arrive) and raises EngineDeadError once the engine is gone.
    guard: Callable[[], None]

    async def call(self, call: TokenizerCall) -> TokenizerCallOutput: ...

    def reply(self, msg: Message) -> None:
        """A TokenizerCallOutput the manager's receive loop read."""

    def fail(self, error: BaseException) -> None:
        """The engine died: every pending call raises `error`."""

    def close(self) -> None: ...


class RemoteTokenizer:
    def __init__(self, send: Sender, has_chat_template: bool, timeout: float = CALL_TIMEOUT_S) -> None:
        self.calls = ControlCalls(send, timeout, quiet_late=True)
        self.has_chat_template = has_chat_template
        self.vocab: list[str] | None = None
        self.vocab_loading: asyncio.Future[TokenizerCallOutput] | None = None
        self.guard = _no_guard

    async def call(self, call: TokenizerCall) -> TokenizerCallOutput:
        self.guard()
        return await self.calls.call(call, TokenizerCallOutput)

    def reply(self, msg: Message) -> None:
        self.calls.reply(msg)

    def fail(self, error: BaseException) -> None:
        self.calls.fail(error)

    def close(self) -> None:
        self.calls.send.close()


class LocalTokenizer:
    def __init__(self, tokenizer: Any, threads: int = 4) -> None:
        self.tokenizer = tokenizer
        self.has_chat_template = bool(getattr(tokenizer, "chat_template", None))
        self.vocab: list[str] | None = None
        self.vocab_loading: asyncio.Future[TokenizerCallOutput] | None = None
        self.limiter = anyio.CapacityLimiter(threads)
        self.guard = _no_guard

    async def call(self, call: TokenizerCall) -> TokenizerCallOutput:
        self.guard()
        return await anyio.to_thread.run_sync(run_call, self.tokenizer, call, limiter=self.limiter)

    def reply(self, msg: Message) -> None:
        pass  # its calls answer in-process

    def fail(self, error: BaseException) -> None:
        pass  # a thread's call ends on its own

    def close(self) -> None:
        pass


async def checked(tok: Tokenizing, call: TokenizerCall, field: str) -> TokenizerCallOutput:
    """The call's answer; ValueError naming `field` for input too large to send or one
    the tokenizer refused."""
    size = sum(len(t) for t in call.texts)
    if size * 4 > MAX_TEXT_BYTES and sum(len(t.encode()) for t in call.texts) > MAX_TEXT_BYTES:
        raise ValueError(f"{field}: {size} characters is more than one request may carry ({MAX_TEXT_BYTES} bytes)")
    out = await tok.call(call)
    if out.error is not None:
        raise ValueError(f"{field}: the tokenizer rejected it: {out.error}")
    return out


async def encode(tok: Tokenizing, texts: list[str], add_special_tokens: bool = True,
                 field: str = "prompt") -> list[list[int]]:
    return (await checked(tok, TokenizerCall(op="encode", texts=texts, add_special_tokens=add_special_tokens),
                          field)).ids


async def decode(tok: Tokenizing, ids: list[list[int]], skip_special_tokens: bool = False) -> list[str]:
    return (await checked(tok, TokenizerCall(op="decode", ids=ids, skip_special_tokens=skip_special_tokens),
                          "tokens")).texts


async def token_strs(tok: Tokenizing, ids: list[list[int]]) -> list[list[str]]:
    return (await checked(tok, TokenizerCall(op="token_strs", ids=ids), "tokens")).strs


async def chat_ids(tok: Tokenizing, conversation: list[dict[str, Any]], add_generation_prompt: bool = True,
                   continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
                   template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """The conversation's prompt ids through the chat template; ValueError naming
    `messages` when the template rejects it."""
    call = TokenizerCall(op="chat", conversation=conversation, add_generation_prompt=add_generation_prompt,
                         continue_final_message=continue_final_message, tools=tools,
                         template_kwargs=template_kwargs or {})
    out = await tok.call(call)
    if out.error is not None:
        raise ValueError(f"messages: the chat template rejected them: {out.error}")
    return out.ids[0]


async def load_vocab(tok: Tokenizing, size: int) -> list[str]:
    """Each id's text alone (logprob texts), fetched once per client: concurrent
    requests share the one call in flight."""
    while tok.vocab is None or len(tok.vocab) < size:
        if tok.vocab_loading is None:
            tok.vocab_loading = asyncio.ensure_future(checked(tok, TokenizerCall(op="vocab_texts", size=size), "vocab"))
        loading = tok.vocab_loading
        try:
            tok.vocab = (await asyncio.shield(loading)).texts
        finally:
            if loading.done() and tok.vocab_loading is loading:
                tok.vocab_loading = None  # a failed load is tried again by the next request
    return tok.vocab
