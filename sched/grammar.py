"""Structured output in the scheduler: requests' grammars (json_schema, regex, ebnf)
compiled by xgrammar (the grammar engine SGLang and vLLM use) off the loop, on a
worker thread, and kept by xgrammar's compiler cache; a request waits here, not in
the queue, until its grammar is ready. A grammar that fails to compile ends its
request with an abort reason that carries status_code 400 and names the field.

A ready request holds an xgrammar GrammarMatcher (`req.grammar`). Grammar requests
keep the overlap loop: a batch's forward is queued before the previous step's results
are processed; then each matcher takes the tokens sampled since its last mask, and the
masks are filled on the fill thread while the scheduler builds the next batch; mask
and sampling are queued after (sgl.sched.runner.step.Step's hooks,
sgl.sched.runner.grammar_masks). Beams under a grammar run their steps serially.

The bitmasks cover the tokenizer's ids, not the model's padded vocabulary: xgrammar
counts every id past the tokenizer's as a special token and scans them on each
accepted token (on a 2-core CPU 56 us a token instead of 7 for 151,936 columns over a
49,152-id tokenizer: benchmarks.grammar_cost.matcher_costs); the sampler disallows the
columns past the mask instead.

It never builds batches and never touches logits."""

from __future__ import annotations

import functools
import re
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from sgl.core.log import get_logger
from sgl.core.protocol import GRAMMAR_EMPTY, GRAMMAR_UNCOMPILED
from sgl.sched.json_schema_rewrite import for_xgrammar
from sgl.sched.models.parallel import TPGroup
from sgl.sched.models.tokenizer import load_tokenizer
from sgl.sched.req import Req
from sgl.sched.runner.grammar_masks import allows_any, grammar_kind

COMPILE_THREADS = 2  # xgrammar's own threads per compile; one compile at a time here
MAX_JSON_WHITESPACE = 2  # whitespace characters in a row between JSON tokens
RECENT_GRAMMARS = 32  # compiles (running or done) kept by (kind, text): a batch of one schema compiles once


def _backend() -> Any:
    try:
        import xgrammar
    except ImportError as e:  # a clear error, not an ImportError from inside the scheduler
        raise ValueError("structured output needs the xgrammar package: pip install xgrammar") from e
    return xgrammar


class Grammars:
    """Compiles grammars for one scheduler; created with the tokenizer's path."""

    def __init__(self, tokenizer_path: str | None, vocab_size: int, eos_ids: set[int], trust_remote_code: bool,
                 enabled: bool = True, tp: TPGroup = TPGroup()) -> None:
        self.tokenizer_path = tokenizer_path
        self.tp = tp
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self.trust_remote_code = trust_remote_code
        self.enabled = enabled
        self.log = get_logger("scheduler")
        self._pool: ThreadPoolExecutor | None = None
        self._compiler: Any = None
        self.pending: dict[Req, Future[Any]] = {}
        # The same grammar twice is one compile: 256 requests of one schema, each compiled in
        # turn on the one thread (each a cache hit of xgrammar's), trickled into the batch.
        self._recent: OrderedDict[tuple[str, str], Future[Any]] = OrderedDict()

    def error(self, req: Req) -> str | None:
        """Why this engine cannot constrain the request at all, or None."""
        g = req.sampling_params.grammar
        if g is None:
            return None
        if not self.enabled:
            return f"{g[0]}: structured output is off in this engine (grammar_backend='none')"
        if self.tokenizer_path is None:
            return f"{g[0]}: structured output needs a tokenizer, and this engine runs with skip_tokenizer_init"
        return None

    def submit(self, req: Req) -> None:
        """Start compiling the request's grammar (it waits in `pending`)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="sgl-grammar")
        key: tuple[str, str] = req.sampling_params.grammar  # type: ignore[assignment]
        fut = self._recent.get(key)
        if fut is None or fut.cancelled():
            fut = self._pool.submit(self._compile, *key)
            self._recent[key] = fut
            if len(self._recent) > RECENT_GRAMMARS:
                self._recent.popitem(last=False)
        self._recent.move_to_end(key)
        self.pending[req] = fut

    def ready(self) -> list[tuple[Req, dict[str, Any] | None]]:
        """The pending requests whose compile is done, each with None (its matcher is set:
        it may join the queue) or the abort reason it must end with: its own pending
        abort, or a failed compile (the caller's error: status_code 400)."""
        finished = {f for f in set(self.pending.values()) if f.done()}  # once per compile: its requests join together
        done = [(r, f) for r, f in self.pending.items() if f in finished]
        if self.tp.size > 1:
            # Compiles finish at different times on each rank: rank 0's set is every rank's
            # (the others wait for theirs), so all admit the same requests in the same step.
            rids = self.tp.broadcast_object([r.rid for r, _ in done])
            by_rid = {r.rid: (r, f) for r, f in self.pending.items()}
            done = [by_rid[rid] for rid in rids]
            wait([f for _, f in done])
        out: list[tuple[Req, dict[str, Any] | None]] = []
        for req, fut in done:
            del self.pending[req]
            if req.to_abort is not None:
                out.append((req, {"type": "abort", "message": req.to_abort}))
                continue
            try:
                compiled = fut.result()
                req.grammar = _backend().GrammarMatcher(compiled)
                req.grammar_width = compiled.tokenizer_info.vocab_size
                out.append((req, None))
            except Exception as e:  # noqa: BLE001 - the caller's grammar: their 400
                if isinstance(e, EmptyGrammar):
                    why = str(e)
                else:  # xgrammar's messages start with a time and a source location: the caller needs neither
                    text = re.sub(r"^\[[\d:]+\] \S+: (Check failed: \(.*?\) is false: )?", "", str(e).strip())
                    why = f"{GRAMMAR_UNCOMPILED}: {text[:500]}"
                out.append((req, {"type": "abort", "status_code": 400, "message": f"{grammar_kind(req)}: {why}"}))
        return out

    def drop(self, req: Req) -> bool:
        """Forget a pending request (aborted); whether it was pending."""
        fut = self.pending.pop(req, None)
        if fut is not None and not any(f is fut for f in self.pending.values()):
            fut.cancel()  # not started yet and nobody else's: never compiled
        return fut is not None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- the worker thread ----

    def _compile(self, kind: str, text: str) -> Any:
        if self._compiler is None:
            assert self.tokenizer_path is not None  # error() refused grammars without a tokenizer
            self._compiler, _ = _compiler_for(self.tokenizer_path, self.trust_remote_code,
                                                       self.vocab_size, tuple(self.eos_ids))
        if kind == "json_schema":
            # Whitespace between tokens stays allowed but bounded: a small model left free
            # can emit it until max_new_tokens, and the JSON never closes.
            compiled = self._compiler.compile_json_schema(for_xgrammar(text), max_whitespace_cnt=MAX_JSON_WHITESPACE)
        elif kind == "regex":
            compiled = self._compiler.compile_regex(text)
        else:
            compiled = self._compiler.compile_grammar(text)
        if not allows_any(_backend().GrammarMatcher(compiled), compiled.tokenizer_info.vocab_size):
            raise EmptyGrammar(GRAMMAR_EMPTY)
        return compiled


class EmptyGrammar(ValueError):
    """A grammar that compiles yet allows no first token, not even EOS."""


@functools.lru_cache(maxsize=4)
def _compiler_for(tokenizer_path: str, trust_remote_code: bool, vocab_size: int,
                  eos_ids: tuple[int, ...]) -> tuple[Any, int]:
    """One xgrammar compiler (and its grammar cache) per tokenizer in a process: engines
    of one process (inproc roles, tests) share it instead of each reading the whole
    vocabulary into a TokenizerInfo again (seconds for a 50k vocabulary). xgrammar's
    compiler is safe to call from several threads."""
    xgr = _backend()
    tok = load_tokenizer(tokenizer_path, trust_remote_code)
    width = tokenizer_width(tok, vocab_size, eos_ids)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=width, stop_token_ids=list(eos_ids))
    return xgr.GrammarCompiler(info, max_threads=COMPILE_THREADS), width


def tokenizer_width(tok: Any, vocab_size: int, eos_ids: tuple[int, ...] = ()) -> int:
    """The grammar bitmasks' width: the tokenizer's ids (EOS included), within the
    model's `vocab_size` columns (see the module's docstring)."""
    return min(vocab_size, max([*tok.get_vocab().values(), *eos_ids]) + 1)
