"""A generate call as data: `GenerateRequest` is what the strategies draw and what the
contract checker reads, and it can run itself on an engine (an `AsyncEngine`-like
one, or an `Engine`-like one through `run_sync`).

It splits a batch into its prompts with the engine's own batch code
(sgl/engine/batch_args.py) and reads sampling parameters through `SamplingParams`;
it checks nothing else and holds no engine state."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, Protocol

from sgl.core.sampling_params import SamplingParams
from sgl.engine.batch_args import batch_options, index_offsets, options_of, split_batch
from sgl.runtime.req_options import ReqOptions


class AsyncGenerating(Protocol):
    """What `GenerateRequest.run` needs of an engine: `AsyncEngine`'s generate and stream."""

    def generate(self, *args: Any, **kwargs: Any) -> Awaitable[Any]: ...

    def stream(self, *args: Any, **kwargs: Any) -> AsyncIterator[dict[str, Any]]: ...


class SyncGenerating(Protocol):
    """What `GenerateRequest.run_sync` needs: `Engine`'s generate (an iterator with stream=True)."""

    def generate(self, *args: Any, **kwargs: Any) -> Any: ...


@dataclass(frozen=True)
class RequestItem:
    """One prompt of a request, as the engine reads it."""

    position: int  # in the batch; 0 for a lone request
    prompt: str | None
    input_ids: list[int] | None
    params: SamplingParams
    options: ReqOptions
    rid: str | None
    first_index: int  # the "index" of its first sample's chunks in a stream of several samples

    @property
    def samples(self) -> int:
        """How many results it gives: n, or the beams of a beam request (one list)."""
        return self.params.n

    @property
    def is_beam(self) -> bool:
        return self.params.beam_width > 0

    @property
    def deterministic(self) -> bool:
        """Whether two runs give the same tokens: greedy (beams are), or seeded."""
        return self.params.is_greedy or self.params.seed is not None

    def sample_id(self, sample: int) -> str | None:
        """The meta_info id sample `sample` must carry, when the request named its rid."""
        if self.rid is None:
            return None
        return self.rid if self.params.n == 1 else f"{self.rid}-{sample}"


@dataclass(frozen=True)
class GenerateRequest:
    """The arguments of one `generate` or `stream` call (a batch when `prompt` is a list
    or `input_ids` a list of lists). `options` are the request-level keyword arguments
    (return_logprob, logprob_start_len, top_logprobs_num, token_ids_logprob,
    return_text_in_logprobs, custom_logit_processor, detokenize); in a batch a list
    value gives one per prompt, as the engines take them."""

    prompt: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    options: dict[str, Any] = field(default_factory=dict)
    rid: str | list[str] | None = None
    stream: bool = False

    @property
    def is_batch(self) -> bool:
        return split_batch(self.prompt, self.input_ids, self.sampling_params, self.rid) is not None

    def items(self) -> list[RequestItem]:
        """Its prompts in order; a ValueError (the engine's) for arguments the engine refuses."""
        split = split_batch(self.prompt, self.input_ids, self.sampling_params, self.rid)
        if split is None:
            one = [(self.prompt, self.input_ids, self.sampling_params, self.rid)]
            return self._items(one, [options_of(dict(self.options))], [0])
        opts = batch_options(dict(self.options), len(split))
        return self._items(split, opts, index_offsets([sp for _, _, sp, _ in split]))

    @staticmethod
    def _items(split: list[tuple[Any, Any, Any, Any]], opts: list[ReqOptions],
               offsets: list[int]) -> list[RequestItem]:
        return [RequestItem(i, p, ids, SamplingParams.coerce(sp), o, r, first)
                for i, ((p, ids, sp, r), o, first) in enumerate(zip(split, opts, offsets))]

    def arguments(self) -> dict[str, Any]:
        """The keyword arguments of the engine call (stream aside)."""
        args: dict[str, Any] = {"sampling_params": self.sampling_params, **self.options}
        if self.prompt is not None:
            args["prompt"] = self.prompt
        if self.input_ids is not None:
            args["input_ids"] = self.input_ids
        if self.rid is not None:
            args["rid"] = self.rid
        return args

    def streamed(self, stream: bool = True) -> GenerateRequest:
        """The same request, streamed or not."""
        return dataclasses.replace(self, stream=stream)

    async def run(self, engine: AsyncGenerating) -> Any:
        """Its result, or with `stream` the list of its chunks."""
        if self.stream:
            return [chunk async for chunk in engine.stream(**self.arguments())]
        return await engine.generate(**self.arguments())

    def run_sync(self, engine: SyncGenerating) -> Any:
        """As `run`, on a blocking engine (`sgl.Engine`)."""
        if self.stream:
            return list(engine.generate(**self.arguments(), stream=True))
        return engine.generate(**self.arguments())
