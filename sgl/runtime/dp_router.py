"""Data parallelism on the tokenizer manager's side: one sender over N scheduler replicas.

A generate request goes where its prompt's longest routed prefix went (prefix affinity,
as SGLang's cache-aware router: that replica's radix cache likely holds it), unless that
replica is much busier than the least busy one; a request with no routed prefix goes to
the least busy. The prefix index is approximate by design: prompts are cut into blocks
of BLOCK ids, each prefix of whole blocks hashed (a chain, so equal hashes mean equal
prefixes with overwhelming likelihood), and each hash remembers the replica that last
got it, the oldest forgotten past MAX_ENTRIES. Busy = requests sent and not finished.
An n > 1 sample follows its prefix leader; an abort goes to the replica of its request;
everything else (control calls, shutdown) goes to every replica, and `merge_replies`
folds their N replies into one. It never looks inside a replica and never blocks."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import msgspec

from sgl.core.protocol import (
    AbortReq,
    ControlReqOutput,
    FlushCacheReqOutput,
    GenerateReqInput,
    GetServerInfoReqOutput,
    HealthCheckOutput,
    Message,
    SetFaultsReqOutput,
)
from sgl.transports.channel import Sender

BLOCK = 32  # ids per hashed prefix block: shorter shared prefixes are not worth routing for
MAX_ENTRIES = 1 << 20  # prefix hashes remembered
# Affinity yields to balance past this: the matched replica has more than
# BALANCE_FACTOR x the least busy one's load + BALANCE_SLACK requests in flight.
BALANCE_FACTOR = 2
BALANCE_SLACK = 16
# Server-info fields that are one engine's settings, equal on every replica: kept, not summed.
SAME_KEYS = frozenset({
    "model_path", "device", "dtype", "vocab_size", "context_length", "eos_token_ids", "chunked_prefill_size",
    "max_queued_requests", "max_top_logprobs_num",
})
# Control-plane reply data that counts requests: each replica counts its own.
SUMMED_DATA = frozenset({"aborted", "num_paused_requests"})


class DataParallelSender(Sender):
    def __init__(self, replicas: list[Sender]) -> None:
        self.replicas = replicas
        self.load = [0] * len(replicas)  # requests in flight per replica
        self.routed: dict[str, int] = {}  # rid -> replica, until it finishes
        self.prefixes: OrderedDict[int, int] = OrderedDict()  # prefix-chain hash -> replica
        self.sent = [0] * len(replicas)  # generate requests routed to each, ever
        self.affine = [0] * len(replicas)  # of which by prefix affinity

    def send(self, msg: Message) -> None:
        if isinstance(msg, GenerateReqInput):
            k = self._route(msg)
            self.routed[msg.rid] = k
            self.load[k] += 1
            self.sent[k] += 1
            self.replicas[k].send(msg)
        elif isinstance(msg, AbortReq) and (at := self.routed.get(msg.rid)) is not None:
            self.replicas[at].send(msg)
        else:  # control calls, shutdown, an abort of an unknown rid
            for r in self.replicas:
                r.send(msg)

    def finished(self, rid: str) -> None:
        """The request ended (finished, failed or aborted): it no longer loads its replica."""
        k = self.routed.pop(rid, None)
        if k is not None:
            self.load[k] -= 1

    def stats(self) -> list[dict[str, int]]:
        return [{"routed": s, "routed_by_prefix": a, "in_flight": n}
                for s, a, n in zip(self.sent, self.affine, self.load)]

    def merge(self, replies: list[Message]) -> Message:
        """One reply from every replica's reply to the same control call (server info:
        the sums, each replica's own under "replicas", and the routing counts)."""
        out = merge_replies(replies)
        if isinstance(out, GetServerInfoReqOutput):
            for info, routing in zip(out.info["replicas"], self.stats()):
                info.update(routing)
        return out

    def close(self) -> None:
        for r in self.replicas:
            r.close()

    def _route(self, msg: GenerateReqInput) -> int:
        if msg.prefix_leader is not None and (k := self.routed.get(msg.prefix_leader)) is not None:
            return k  # a sample waits for its leader's prompt in that replica's cache
        chain = prefix_chain(msg.input_ids)
        least = min(range(len(self.load)), key=self.load.__getitem__)
        k = next((self.prefixes[h] for h in reversed(chain) if h in self.prefixes), None)
        if k is not None and self.load[k] <= BALANCE_FACTOR * self.load[least] + BALANCE_SLACK:
            self.affine[k] += 1
        else:
            k = least
        for h in chain:
            self.prefixes[h] = k
            self.prefixes.move_to_end(h)
        while len(self.prefixes) > MAX_ENTRIES:
            self.prefixes.popitem(last=False)
        return k


def prefix_chain(ids: list[int]) -> list[int]:
    """The hash of each prefix of whole BLOCK-id blocks, shortest first."""
    out: list[int] = []
    h = 0
    for i in range(BLOCK, len(ids) + 1, BLOCK):
        h = hash((h, tuple(ids[i - BLOCK : i])))
        out.append(h)
    return out


def merge_replies(replies: list[Message]) -> Message:
    """One reply from every replica's reply to the same control call."""
    first = replies[0]
    if isinstance(first, GetServerInfoReqOutput):
        infos = [r.info for r in replies if isinstance(r, GetServerInfoReqOutput)]
        merged: dict[str, Any] = {}
        for key, value in infos[0].items():
            if key not in SAME_KEYS and isinstance(value, (int, float)) and not isinstance(value, bool):
                merged[key] = sum(i.get(key, 0) for i in infos)  # counters and capacities add up
            else:
                merged[key] = value
        merged["replicas"] = infos
        return msgspec.structs.replace(first, info=merged)
    if isinstance(first, FlushCacheReqOutput):
        ok = all(r.success for r in replies if isinstance(r, FlushCacheReqOutput))
        return msgspec.structs.replace(first, success=ok)
    if isinstance(first, SetFaultsReqOutput):
        refused = [r for r in replies if isinstance(r, SetFaultsReqOutput) and not r.success]
        return refused[0] if refused else first
    if isinstance(first, ControlReqOutput):
        outs = [r for r in replies if isinstance(r, ControlReqOutput)]
        failed = next((r for r in outs if not r.success), None)
        data = {k: sum(r.data.get(k, 0) for r in outs) if k in SUMMED_DATA else v for k, v in first.data.items()}
        return msgspec.structs.replace(first, success=failed is None,
                                       message=first.message if failed is None else failed.message, data=data)
    if isinstance(first, HealthCheckOutput):
        return msgspec.structs.replace(first, ok=all(r.ok for r in replies if isinstance(r, HealthCheckOutput)))
    return first
