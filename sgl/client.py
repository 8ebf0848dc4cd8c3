"""`sgl.Client`: an asyncio client of a running `sgl serve`, over httpx.

    async with sgl.Client("http://127.0.0.1:30000", api_key=None) as c:
        out = await c.generate("Hello", {"max_new_tokens": 8})
        async for chunk in c.stream("Hello", {"max_new_tokens": 8}, rid="r1"):
            ...
        await c.abort("r1")

It speaks the native API (/generate) and returns the same dicts as the engines:
{"text", "output_ids", "meta_info"}, streams as delta chunks (each holds what is
new, whichever way the server streams: SGLang's cumulative chunks are cut back
to their new part). A 400 from the
server is raised as ValueError, a missing or wrong key as PermissionError, any
other failure as ServerError (a server that cannot be reached, or a connection that
breaks or times out, too: status 503). It imports nothing of the engine."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

import httpx


class ServerError(RuntimeError):
    """The server failed the request (5xx, or an error event in a stream)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status


# The HTTP status an error event in a stream stands for, by its OpenAI error type.
_TYPE_STATUS = {"invalid_request_error": 400, "authentication_error": 401, "not_found_error": 404,
                "service_unavailable_error": 503}


def _raise_for(status: int | None, body: Any) -> None:
    """Raise what an error response (`status`) or a stream's error event (None) means."""
    err = body.get("error") if isinstance(body, dict) else None
    message = err.get("message", str(err)) if isinstance(err, dict) else str(body)
    if status is None:
        status = _TYPE_STATUS.get(str(err.get("type")) if isinstance(err, dict) else "", 500)
    if status in (400, 413):
        raise ValueError(message)
    if status == 401:
        raise PermissionError(message)
    raise ServerError(status, message)


@contextmanager
def _transport_errors() -> Iterator[None]:
    """httpx's connection failures (refused, broken, timed out) as ServerError."""
    try:
        yield
    except httpx.TransportError as e:
        raise ServerError(503, f"{type(e).__name__}: {e or 'the connection to the server failed'}") from e


class Client:
    def __init__(self, url: str, api_key: str | None = None, timeout: float | None = 600.0,
                 max_connections: int | None = None) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key is not None else {}
        self._http = httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers, timeout=timeout,
                                       limits=httpx.Limits(max_connections=max_connections,
                                                           max_keepalive_connections=64))

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _post(self, path: str, payload: dict[str, Any]) -> Any:
        with _transport_errors():
            r = await self._http.post(path, json=payload)
        return self._json(r)

    async def _get(self, path: str) -> Any:
        with _transport_errors():
            r = await self._http.get(path)
        return self._json(r)

    @staticmethod
    def _json(r: httpx.Response) -> Any:
        try:
            body = r.json() if r.content else None
        except ValueError:
            body = r.text
        if r.status_code >= 400:
            _raise_for(r.status_code, body)
        return body

    async def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        rid: str | list[str] | None = None,
        **options: Any,
    ) -> dict[str, Any] | list[Any]:
        """One dict for one prompt; a list, in order, for a batch. With n > 1 or
        beam_width >= 1 in sampling_params a prompt gives a list of dicts (samples, or
        beams best first), as the engines return them. `options`: the
        native route's other fields (return_logprob, logprob_start_len, top_logprobs_num,
        token_ids_logprob, return_text_in_logprobs); an unknown one is a 400."""
        return await self._post("/generate", _payload(prompt, sampling_params, input_ids, rid, False, options))

    async def stream(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        rid: str | list[str] | None = None,
        **options: Any,
    ) -> AsyncIterator[dict[str, Any]]:
        """Delta chunks; the last has a finish_reason. A batch's chunks interleave, each
        with its "index" (as `AsyncEngine.stream`). Leaving early aborts the request(s)
        (the server sees the connection close). `options` as for generate."""
        payload = _payload(prompt, sampling_params, input_ids, rid, True, options)
        with _transport_errors():
            async with self._http.stream("POST", "/generate", json=payload) as r:
                if r.status_code >= 400:
                    await r.aread()
                    self._json(r)
                # sgl serve streams everything so far in each chunk unless it runs with
                # --incremental-streaming-output; either way this yields what is new.
                cumulative = r.headers.get("x-sgl-stream-output") == "cumulative"
                seen: dict[int, dict[str, int]] = {}
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    item = json.loads(data)
                    if "error" in item:
                        _raise_for(None, item)
                    yield _new_part(item, seen) if cumulative else item

    async def abort(self, rid: str) -> None:
        await self._post("/abort_request", {"rid": rid})

    async def health(self) -> bool:
        """Whether the server answers that it is healthy (False where it cannot be reached)."""
        try:
            r = await self._http.get("/health")
        except httpx.TransportError:
            return False
        return r.status_code == 200

    async def get_server_info(self) -> dict[str, Any]:
        return await self._get("/get_server_info")

    async def get_model_info(self) -> dict[str, Any]:
        return await self._get("/get_model_info")

    async def flush_cache(self) -> dict[str, Any]:
        return await self._post("/flush_cache", {})

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, Any]:
        """Load a LoRA adapter (a PEFT folder on the server's machine) under a name that
        requests then give as `lora_path` (docs/lora.md): {"success", "message",
        "loaded_adapters"}; a refusal (bad folder, name in use) is a ValueError."""
        return await self._post("/load_lora_adapter", {"lora_name": lora_name, "lora_path": lora_path})

    async def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        """Unload a LoRA adapter by name (refused, as a ValueError, while a request uses it)."""
        return await self._post("/unload_lora_adapter", {"lora_name": lora_name})


def _new_part(chunk: dict[str, Any], seen: dict[int, dict[str, int]]) -> dict[str, Any]:
    """A cumulative chunk's new part (text, output ids, logprob lists): the delta
    chunk the engines give. `seen`: the lengths sent so far, per request index."""
    lengths = seen.setdefault(chunk.get("index", 0), {})
    out = dict(chunk)
    for key in ("text", "output_ids"):
        if key in chunk:
            out[key] = chunk[key][lengths.get(key, 0):]
            lengths[key] = len(chunk[key])
    meta = dict(chunk.get("meta_info") or {})
    for key, value in list(meta.items()):
        if key.endswith("_logprobs") and isinstance(value, list):
            meta[key] = value[lengths.get(key, 0):]
            lengths[key] = len(value)
    out["meta_info"] = meta
    return out


def _payload(prompt: Any, sp: Any, input_ids: Any, rid: Any, stream: bool, options: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {**options, "stream": stream}
    for name, value in (("text", prompt), ("sampling_params", sp), ("input_ids", input_ids), ("rid", rid)):
        if value is not None:
            out[name] = value
    return out
