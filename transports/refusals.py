"""What a receiver refused, counted, and logged once per peer and kind.

Kinds: "auth" (a frame or connection that failed authentication: wrong or missing
HMAC tag, a CURVE handshake that failed or a client key not allowed, a frame that
failed decryption), "replay" (shared-key mode: a sequence number already seen),
"malformed" (authenticated but not a protocol message, or oversized) and "policy"
(a message the receiver's policy hook refused). The counts live in a plain dict of
numbers under the names `transport_refused` (all kinds) and
`transport_refused_<kind>`, so a role can hand the receiver the dict it reports
(the scheduler's stats, which its get_server_info shows).

A peer is a client's public key where the transport knows it, else its IP address,
else "unknown". It never raises and never decides anything itself."""

from __future__ import annotations

from typing import Any

from sgl.core.log import get_logger

log = get_logger("transport")

KINDS = ("auth", "replay", "malformed", "policy")
TOTAL = "transport_refused"
MAX_LOGGED_PEERS = 1024  # (peer, kind) pairs remembered for log-once; past it, nothing new is logged


def empty_counts() -> dict[str, float]:
    return {TOTAL: 0, **{f"{TOTAL}_{k}": 0 for k in KINDS}}


class Refusals:
    def __init__(self, address: str) -> None:
        self.address = address
        self.counts: dict[str, float] = empty_counts()
        self._logged: set[tuple[str, str]] = set()
        self._saturated = False

    def count_into(self, counts: dict[str, float]) -> None:
        """Count in `counts` from now on (what was counted so far moves there)."""
        for k, v in self.counts.items():
            counts[k] = counts.get(k, 0) + v
        self.counts = counts

    def refuse(self, kind: str, peer: str, event: str, **detail: Any) -> None:
        self.counts[TOTAL] = self.counts.get(TOTAL, 0) + 1
        name = f"{TOTAL}_{kind}"
        self.counts[name] = self.counts.get(name, 0) + 1
        key = (peer, kind)
        if key in self._logged:
            return
        if len(self._logged) >= MAX_LOGGED_PEERS:
            if not self._saturated:
                self._saturated = True
                log.warning("refusing frames from many peers: no longer logging new ones (still counted)",
                            address=self.address, counter=TOTAL)
            return
        self._logged.add(key)
        log.warning(event, address=self.address, peer=peer, kind=kind, counter=name,
                    note="logged once per peer and kind; later ones are only counted", **detail)
