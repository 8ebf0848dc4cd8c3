"""The engines: `AsyncEngine` for code inside an event loop (also attached to a
running server with `AsyncEngine.connect`), `Engine` for scripts. They start and
stop the roles and hand requests to the tokenizer manager; they hold no request
state of their own."""

from sgl.engine.async_engine import AsyncEngine
from sgl.engine.sync_engine import Engine
from sgl.runtime.tokenizer_manager import EngineDeadError, ServerBusyError

__all__ = ["AsyncEngine", "Engine", "EngineDeadError", "ServerBusyError"]
