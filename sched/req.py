"""Req: one request's state inside the scheduler.

KV ownership: `prefix_indices` are slots owned by the radix tree (locked through
`last_node` while the request runs); req_to_token[row, len(prefix_indices):kv_len]
are slots the request owns itself until it is cached or freed.

A beam-search request (beam_width >= 1) holds `beam.width` rows: the prompt is
prefilled in its own row, and from the first selection on each row is one running
beam, all of the same length (`output_ids` is the best running beam's). Row
positions past the prompt point at slots that sgl.cache.beam_tails shares between
the beams descending from one another."""

from __future__ import annotations

from typing import Any

import torch

from sgl.core.protocol import Beam, GenerateReqInput, Logprobs
from sgl.core.sampling_params import SamplingParams
from sgl.core.trie import Trie
from sgl.sched.models.pooling import PooledPrompt

_EMPTY = torch.empty(0, dtype=torch.int64)


class BeamState:
    """The host's view of a beam request's beams, as of its last processed step."""

    __slots__ = ("width", "rows", "outputs", "scores", "finished", "open", "result", "matchers")

    def __init__(self, width: int) -> None:
        self.width = width
        self.rows: list[int] = []  # its request rows, rows[0] the request's own; given at admission
        self.reset()

    def reset(self) -> None:
        """Back to before the first step (a retracted beam request starts over)."""
        # The running beams, one per source row of the next step (one before the first selection).
        self.outputs: list[list[int]] = [[]]
        self.scores: list[float] = [0.0]  # their cumulative logprobs (masks included: < -1e8 is a dead beam)
        # (score, cumulative logprob, output ids, finish reason), best first, at most width.
        self.finished: list[tuple[float, float, list[int], dict[str, Any]]] = []
        self.open = True  # HF's "the running beams may still beat the finished ones"
        self.result: list[Beam] | None = None  # the beams sent, once finished
        # Under a grammar: each running beam's own matcher (forked from its parent's at each
        # selection); None before the first selection, when the request's untouched one serves.
        self.matchers: list[Any] | None = None


class Req:
    __slots__ = (
        "rid", "origin_input_ids", "sampling_params", "stream", "output_ids", "req_pool_idx",
        "prefix_indices", "last_node", "kv_len", "extend_len", "finished_reason", "sent_len",
        "cached_tokens", "to_abort", "retractions", "inflight", "epoch",
        "return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob", "processor",
        "detokenize", "prefix_leader", "is_leader", "prompt_done", "logprobs", "beam", "trie", "serial", "grammar",
        "grammar_width", "grammar_seen", "grammar_after", "arrival", "oom_retried", "embed", "pooled", "embedding",
        "priority", "timeout", "deadline", "lora_name", "lora_id", "lora_slot", "spec",
        "stale_input", "draft_len", "running",
    )

    def __init__(self, rid: str, input_ids: list[int], sampling_params: SamplingParams, stream: bool,
                 msg: GenerateReqInput | None = None) -> None:
        self.rid = rid
        self.origin_input_ids = input_ids
        self.sampling_params = sampling_params
        self.stream = stream
        m = msg or GenerateReqInput(rid, input_ids, sampling_params, stream)
        self.return_logprob = m.return_logprob
        self.logprob_start_len = m.logprob_start_len if m.return_logprob else -1
        self.top_logprobs_num = m.top_logprobs_num if m.return_logprob else 0
        self.token_ids_logprob = m.token_ids_logprob if m.return_logprob else None
        self.processor = m.custom_logit_processor
        self.detokenize = m.detokenize
        self.prefix_leader = m.prefix_leader
        self.is_leader = False  # n > 1 siblings wait for this request's prompt to be cached
        self.prompt_done = False  # the last prompt chunk has been built into a batch
        self.logprobs: Logprobs | None = Logprobs() if m.return_logprob else None  # not yet sent
        self.output_ids: list[int] = []
        self.req_pool_idx: int | None = None
        self.prefix_indices: torch.Tensor = _EMPTY
        self.last_node: Any = None
        self.kv_len = 0  # tokens whose KV is written, all in req_to_token[row, :kv_len]
        self.extend_len = 0  # tokens the current prefill chunk computes
        self.finished_reason: dict[str, Any] | None = None
        self.sent_len = 0  # output ids already sent to the detokenizer
        self.cached_tokens = 0
        self.to_abort: str | None = None
        self.retractions = 0
        self.inflight = 0  # launched batches holding this request whose results are not processed yet
        self.epoch = 0  # bumped on retraction: results launched before it are stale
        w = sampling_params.beam_width
        self.beam: BeamState | None = BeamState(w) if w >= 1 else None
        self.trie: Trie | None = None  # its constraint's, set by the scheduler on arrival
        # Never overlaps its own steps: the host must know each step's outcome before the next
        # (set by the scheduler: a processor that reads output ids, or beams on a CPU worker).
        self.serial = False
        self.running = False  # in the decode manager's running set (sgl.sched.decode)
        self.grammar: Any = None  # its xgrammar GrammarMatcher, once compiled (sgl.sched.grammar)
        self.grammar_width = 0  # its bitmask's token ids (the tokenizer's), set with the matcher
        # Output ids its matcher has taken: the rest go in just before the request's next
        # mask is filled (sgl.sched.runner.grammar_masks); beams excepted.
        self.grammar_seen = 0
        # The token after which its matcher starts (a reasoning model's end of thinking); None
        # once it came, or for a grammar from the first token (sgl.sched.runner.grammar_masks).
        self.grammar_after: int | None = sampling_params.reasoning_end_id
        # Its place in arrival order (set by the scheduler): retraction takes the youngest KV holder.
        self.arrival = -1
        self.oom_retried = False  # retracted once after a CUDA OOM: the next one aborts it
        self.embed = m.embed  # an embedding request: prefill-only, its prompt pooled
        self.pooled: PooledPrompt | None = None  # its pool, set by the scheduler on arrival
        self.embedding: bytes | None = None  # its vector (float32 bytes), once its prompt is done
        self.priority = m.priority  # higher is more urgent (schedule_policy="priority")
        self.timeout = m.timeout  # seconds from receipt; None: the server's default
        self.deadline: float | None = None  # on the scheduler's clock, set on acceptance (sgl.sched.deadlines)
        self.lora_name = m.lora_path  # its LoRA adapter's name; None: the base model
        self.lora_id = 0  # that adapter's load (sgl.sched.lora), set on acceptance; 0: the base model
        self.lora_slot = -1  # the device slot of its adapter, set at each admission; -1: none
        self.spec: Any = None  # its speculation's state (sgl.sched.speculative.SpecState), from its first step
        # Its row's last-token buffer on the device is not its last token (a speculative step
        # sampled several rows of its row): its next step takes its input from the host.
        self.stale_input = False
        # Positions whose draft-model KV is written, in its row's slots (STANDALONE speculation);
        # at most kv_len: the draft catches up on the rest before it proposes.
        self.draft_len = 0

    @property
    def all_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    def ids_between(self, start: int, end: int) -> list[int]:
        """Its tokens at positions [start, end), without copying the rest (all_ids would)."""
        prompt, n = self.origin_input_ids, len(self.origin_input_ids)
        if end <= n:
            return prompt[start:end]
        if start >= n:
            return self.output_ids[start - n : end - n]
        return prompt[start:] + self.output_ids[: end - n]

    @property
    def fill_ids(self) -> list[int]:
        """The tokens whose KV is written (what the radix cache may insert)."""
        return self.all_ids[: self.kv_len]

    @property
    def cache_namespace(self) -> int:
        """Whose radix-cache prefixes it may share: its adapter's load's (0: the base model's)."""
        return self.lora_id

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def start_logprobs(self) -> None:
        """A new request's logprobs: with logprob_start_len=0 the first prompt token has
        none, which SGLang reports as None."""
        lp = self.logprobs
        if self.logprob_start_len != 0 or lp is None:
            return
        lp.input_ids.append(self.origin_input_ids[0])
        lp.input_vals.append(None)
        if self.top_logprobs_num:
            lp.input_top_vals.append(None)
            lp.input_top_ids.append(None)
        if self.token_ids_logprob:
            lp.input_ids_vals.append(None)

    def drop_prompt_logprobs(self) -> None:
        """Retracted before its prompt was done, it recomputes its prompt logprobs from the
        start: drop the chunks' ones gathered so far (none was sent yet), all but the
        leading None of logprob_start_len=0."""
        if self.logprobs is not None and not self.prompt_done:
            self.logprobs.drop_prompt(keep_first=self.logprob_start_len == 0)

    def end_prompt_logprobs(self) -> None:
        """At its end: its prompt's logprobs all, or none (Logprobs.whole_prompt_or_none)."""
        if self.logprobs is not None:
            self.logprobs.whole_prompt_or_none(len(self.origin_input_ids) - self.logprob_start_len)

    def tokens_left(self, context_length: int) -> int:
        """Output tokens it may still get: max_new_tokens and the context both bound it
        (the one rule for the length finish and for sitting out a decode step)."""
        return min(self.sampling_params.max_new_tokens - len(self.output_ids), context_length - self.seq_len)

    @property
    def prefill_only(self) -> bool:
        """max_new_tokens=0: a prefill (for prompt logprobs) that outputs no token."""
        return self.sampling_params.max_new_tokens == 0

    @property
    def prefix_limit(self) -> int:
        """How many of its leading tokens it may take from the radix cache: never its last
        (whose logits it needs), nor a position whose prompt logprob it returns, nor any
        of a mean-pooled embedding's prompt (the tree keeps no hidden states)."""
        if self.pooled is not None and self.pooled.mode == "mean":
            return 0
        n = len(self.origin_input_ids) + len(self.output_ids) - 1
        return min(n, self.input_logprob_from) if self.needs_input_logprobs else n

    @property
    def needs_input_logprobs(self) -> bool:
        """Prompt logprobs are still to compute (never again after a retraction's re-prefill)."""
        return 0 <= self.logprob_start_len and not self.prompt_done

    @property
    def input_logprob_from(self) -> int:
        """First position whose logits give a prompt logprob (the logits of position p score token p+1)."""
        return max(self.logprob_start_len - 1, 0)

    @property
    def rows(self) -> list[int]:
        """The request rows a decode step runs: each beam's, or its one."""
        return self.beam.rows if self.beam is not None else [self.req_pool_idx]  # type: ignore[list-item]

    @property
    def steered(self) -> bool:
        """Its steps read host state the step before it leaves: beams (the rows their
        selection moves), a grammar (its matcher's next mask), a trie (its next node). Such a
        request never steps in a prefill's forward (a mixed batch), and joins decoding only
        once its prefill's results are in (sgl.sched.decode)."""
        return self.beam is not None or self.grammar is not None or self.trie is not None

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    def __repr__(self) -> str:
        return f"Req({self.rid!r}, in={len(self.origin_input_ids)}, out={len(self.output_ids)}, kv={self.kv_len})"


def beam_offsets(reqs: list[Req]) -> list[int]:
    """Each batch entry's beam: a beam request's rows are consecutive entries, in its
    beams' order, so a row's beam is its offset from the request's first (0 elsewhere)."""
    out = [0] * len(reqs)
    for i in range(1, len(reqs)):
        out[i] = out[i - 1] + 1 if reqs[i] is reqs[i - 1] else 0
    return out
