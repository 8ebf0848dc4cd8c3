"""Request deadlines: each accepted request with a timeout (its own, else the server's
request_timeout) must finish within that many seconds of the scheduler's receipt, on the
scheduler's clock (time.monotonic; the caller's clock is never read). The scheduler asks
`expired` once a turn and ends each request it returns, wherever the request is, as a
client's abort ends it; while idle it waits on its input no longer than `next_in`.

Under tensor parallelism rank 0 alone reads the clock and broadcasts the expired rids,
so every rank ends the same requests in the same turn (sgl.sched.tp_channels).

`Deadlines` holds the live requests that have a deadline, by rid, and a heap of their
deadlines whose entries for ended requests are skipped (and compacted away); a request
leaves it when it ends or expires. It ends nothing itself."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

from sgl.sched.models.parallel import TPGroup
from sgl.sched.req import Req

COMPACT_SLACK = 64  # stale heap entries tolerated beyond the live ones before a rebuild


def deadline_message(timeout: float) -> str:
    """The abort message of a request ended by its deadline."""
    return f"deadline: not finished within {timeout:g} s"


class Deadlines:
    def __init__(self, default_timeout: float | None, clock: Callable[[], float], tp: TPGroup = TPGroup()) -> None:
        self.default_timeout = default_timeout
        self.clock = clock
        self.tp = tp
        self.reqs: dict[str, Req] = {}  # live requests with a deadline
        self._heap: list[tuple[float, int, Req]] = []
        self._seq = itertools.count()  # ties: arrival order, and Reqs are never compared
        self.stats = {"deadline_aborts": 0}

    def add(self, req: Req) -> None:
        """An accepted request: its deadline, if it has one, runs from now."""
        timeout = req.timeout if req.timeout is not None else self.default_timeout
        if timeout is None:
            return
        req.timeout = timeout
        req.deadline = self.clock() + timeout
        self.reqs[req.rid] = req
        heapq.heappush(self._heap, (req.deadline, next(self._seq), req))

    def discard(self, req: Req) -> None:
        """A request ended (by its deadline or otherwise)."""
        if self.reqs.get(req.rid) is req:
            del self.reqs[req.rid]
            if len(self._heap) > 2 * len(self.reqs) + COMPACT_SLACK:
                self._heap = [e for e in self._heap if self.reqs.get(e[2].rid) is e[2]]
                heapq.heapify(self._heap)

    def _top(self) -> tuple[float, int, Req] | None:
        """The nearest live deadline's entry, dropping stale ones above it."""
        heap = self._heap
        while heap and self.reqs.get(heap[0][2].rid) is not heap[0][2]:
            heapq.heappop(heap)
        return heap[0] if heap else None

    def expired(self) -> list[Req]:
        """The live requests whose deadline has passed, taken out (the same on every TP
        rank): the scheduler ends each."""
        if not self.reqs:
            return []  # every rank agrees: the set was built from the same input
        out: list[Req] = []
        if self.tp.rank == 0:
            now = self.clock()
            while (top := self._top()) is not None and top[0] <= now:
                out.append(heapq.heappop(self._heap)[2])
                del self.reqs[top[2].rid]
        if self.tp.size > 1:
            rids = self.tp.broadcast_object([r.rid for r in out] if self.tp.rank == 0 else None)
            out = [self.reqs.pop(rid) for rid in rids] if self.tp.rank else out
        self.stats["deadline_aborts"] += len(out)
        return out

    def next_in(self) -> float | None:
        """Seconds until the nearest deadline (0 when one has passed); None without any."""
        top = self._top()
        return None if top is None else max(0.0, top[0] - self.clock())
