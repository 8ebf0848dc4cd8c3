"""sgl: a compact, typed, asyncio-native LLM serving engine.

    import sgl
    with sgl.Engine() as engine:
        print(engine.generate("What is the capital of France?")["text"])

The engines import on first use, so a child role that needs only the protocol
never pays for them. Nothing the caller's side imports (the engines, the client, the
HTTP server) imports torch or transformers: only the roles that run a model or a
tokenizer do."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sgl.core.log import configure_logging
from sgl.core.sampling_params import SamplingParams
from sgl.core.server_args import ServerArgs
from sgl.core.version import __version__

if TYPE_CHECKING:
    from sgl.client import Client
    from sgl.core.logit_processor import CustomLogitProcessor
    from sgl.engine import AsyncEngine, AttachedEngine, Engine, EngineDeadError, ServerBusyError

__all__ = ["AsyncEngine", "AttachedEngine", "Client", "CustomLogitProcessor", "Engine", "EngineDeadError",
           "SamplingParams", "ServerArgs", "ServerBusyError", "__version__", "configure_logging"]


def __getattr__(name: str) -> Any:
    if name in ("Engine", "AsyncEngine", "AttachedEngine", "EngineDeadError", "ServerBusyError"):
        from sgl import engine

        return getattr(engine, name)
    if name == "Client":
        from sgl.client import Client

        return Client
    if name == "CustomLogitProcessor":
        from sgl.core.logit_processor import CustomLogitProcessor

        return CustomLogitProcessor
    raise AttributeError(f"module 'sgl' has no attribute {name!r}")
