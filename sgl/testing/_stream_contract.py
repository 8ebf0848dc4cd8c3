"""The stream rules of the contract (sgl/testing/contract.py): a stream's chunks grouped
by sample ("index"), each group checked as a run of deltas, then joined into the
result `generate` would have given and checked by the result rules; and, for a
deterministic request, compared with its non-streamed result.

Reads the chunks and never changes them."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from sgl.testing._request import RequestItem
from sgl.testing.contract import LOGPROB_KEYS, LogprobRules, SampleRules, fail, is_int, require, short

if TYPE_CHECKING:
    from sgl.testing._request import GenerateRequest
    from sgl.testing.contract import Contract

_VALUE_TOL = 1e-3  # logprobs of a recomputed (e.g. prefix-cached) prompt may differ in float rounding


class StreamRules:
    def __init__(self, request: GenerateRequest, contract: Contract) -> None:
        self.request = request
        self.contract = contract
        self.items = request.items()
        if any(item.is_beam for item in self.items):
            raise ValueError("a beam request never streams: the engine refuses it")
        # One entry per stream index: (its prompt, its sample number).
        self.samples = [(item, k) for item in self.items for k in range(item.samples)]
        self.several = request.is_batch or len(self.samples) > 1

    def check(self, chunks: Sequence[Any], result: Any) -> None:
        groups = self.grouped(chunks)
        joined = [self.joined(i, group) for i, group in enumerate(groups)]
        self.contract.check_result(self.request.streamed(False), self.assembled(joined))
        if result is not None:
            self.contract.check_result(self.request.streamed(False), result)
            for i, (item, k) in enumerate(self.samples):
                if item.deterministic:
                    self.compare(self.label(i), joined[i], self.result_of(result, item, k))

    def label(self, index: int) -> str:
        item, k = self.samples[index]
        where = f"prompt {item.position}" if self.request.is_batch else "stream"
        return where + (f" sample {k}" if item.samples > 1 else "")

    def grouped(self, chunks: Sequence[Any]) -> list[list[dict[str, Any]]]:
        """The chunks of each stream index, in order; checks what needs the whole stream."""
        require(isinstance(chunks, (list, tuple)), "chunk-shape", "stream", f"chunks are {short(chunks)}")
        groups: list[list[dict[str, Any]]] = [[] for _ in self.samples]
        seen: set[int] = set()
        for pos, chunk in enumerate(chunks):
            require(id(chunk) not in seen, "chunk-repeat", f"chunk {pos}", "the same chunk object came again")
            seen.add(id(chunk))
            require(isinstance(chunk, dict), "chunk-shape", f"chunk {pos}", f"{short(chunk)} is no dict")
            index = chunk.get("index", 0)
            if self.several:
                require(is_int(chunk.get("index")) and 0 <= index < len(self.samples), "chunk-shape",
                        f"chunk {pos}", f"index {chunk.get('index')!r}, want one in [0, {len(self.samples)})")
            else:
                require("index" not in chunk, "chunk-shape", f"chunk {pos}", "an index in a one-sample stream")
            group = groups[index]
            if group:
                require(chunk != group[-1], "chunk-repeat", f"chunk {pos}",
                        f"equals the chunk before it of {self.label(index)}: {short(chunk)}")
                last = group[-1].get("meta_info")
                require(not isinstance(last, dict) or last.get("finish_reason") is None, "chunk-final",
                        f"chunk {pos}", f"comes after the final chunk of {self.label(index)}")
            group.append(chunk)
        for i, group in enumerate(groups):
            if not group:
                item, _ = self.samples[i]
                fail("n" if item.samples > 1 else "chunk-final", self.label(i), "no chunk at all")
        return groups

    def joined(self, index: int, group: list[dict[str, Any]]) -> dict[str, Any]:
        """The group's chunks checked as deltas, then joined into one result dict."""
        item, k = self.samples[index]
        count = 0
        first_id = None
        for j, chunk in enumerate(group):
            where = f"{self.label(index)} chunk {j}"
            rules = SampleRules(item, self.contract.facts, where, k)
            rules.shape(chunk, ("index",) if self.several else ())
            meta = chunk["meta_info"]
            final = j == len(group) - 1
            require((meta.get("finish_reason") is not None) == final, "chunk-final", where,
                    f"finish_reason {short(meta.get('finish_reason'))} on chunk {j} of {len(group)}")
            require(("e2e_latency" in meta) == final, "chunk-shape", where,
                    "e2e_latency belongs on the final chunk alone")
            rules.meta(meta, final)
            first_id = meta["id"] if first_id is None else first_id
            count += len(chunk["output_ids"])
            require(meta["completion_tokens"] == count, "chunk-count", where,
                    f"completion_tokens={meta['completion_tokens']} after {count} streamed ids")
            require(meta["id"] == first_id, "chunk-count", where, f"id {meta['id']!r} after {first_id!r}")
            rules.detokenize(chunk["text"])
            if item.options.return_logprob and isinstance(meta.get("output_token_logprobs"), list):
                require(len(meta["output_token_logprobs"]) == len(chunk["output_ids"]), "chunk-logprobs", where,
                        f"{len(meta['output_token_logprobs'])} output logprobs for {len(chunk['output_ids'])} ids")
            LogprobRules(item, where).check(meta, chunk["output_ids"], meta["prompt_tokens"], delta=True)
        meta = dict(group[-1]["meta_info"])
        for key in LOGPROB_KEYS:
            if key in meta:
                meta[key] = [entry for chunk in group for entry in chunk["meta_info"][key]]
        return {"text": "".join(c["text"] for c in group),
                "output_ids": [t for c in group for t in c["output_ids"]], "meta_info": meta}

    def assembled(self, joined: list[dict[str, Any]]) -> Any:
        """The joined samples in the shape `generate` returns for the request."""
        per_item = [joined[item.first_index] if item.samples == 1
                    else joined[item.first_index : item.first_index + item.samples] for item in self.items]
        return per_item if self.request.is_batch else per_item[0]

    def result_of(self, result: Any, item: RequestItem, sample: int) -> dict[str, Any]:
        entry = result[item.position] if self.request.is_batch else result
        out: dict[str, Any] = entry[sample] if item.samples > 1 else entry
        return out

    @staticmethod
    def compare(where: str, streamed: dict[str, Any], result: dict[str, Any]) -> None:
        for key in ("text", "output_ids"):
            require(streamed[key] == result[key], "stream-join", where,
                    f"joined {key} {short(streamed[key])}, not streamed {short(result[key])}")
        sm, rm = streamed["meta_info"], result["meta_info"]
        for key in ("finish_reason", "prompt_tokens", "completion_tokens"):
            require(sm[key] == rm[key], "stream-join", where, f"{key} {short(sm[key])}, not streamed {short(rm[key])}")
        for key in LOGPROB_KEYS:
            if key in sm and key in rm:
                require(_same_logprobs(key, sm[key], rm[key]), "stream-join", where,
                        f"joined {key} {short(sm[key])}, not streamed {short(rm[key])}")


def _same_logprobs(key: str, a: list[Any], b: list[Any]) -> bool:
    """Equal logprob lists: triples (a `*_token_logprobs` key) or rows of them (None or a
    list), the same ids and texts, values within float rounding."""
    if key.endswith("_token_logprobs"):
        return _same_triples(a, b)
    return len(a) == len(b) and all((x is None) == (y is None) and (x is None or _same_triples(x, y))
                                    for x, y in zip(a, b))


def _same_triples(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(_close(x[0], y[0]) and tuple(x[1:]) == tuple(y[1:]) for x, y in zip(a, b))


def _close(a: float | None, b: float | None) -> bool:
    return (a is None) == (b is None) and (a is None or b is None or math.isclose(a, b, abs_tol=_VALUE_TOL))
