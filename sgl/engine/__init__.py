"""The engines: `AsyncEngine` for code inside an event loop, which starts and owns its
roles; `AttachedEngine` (from `AsyncEngine.connect`), attached to the scheduler of an
engine running in another process; both are an `EngineFrontEnd`. `Engine` runs an
AsyncEngine for scripts. They hand requests to the tokenizer manager and hold no
request state of their own."""

from sgl.engine.async_engine import AsyncEngine
from sgl.engine.attached_engine import AttachedEngine
from sgl.engine.front_end import EngineFrontEnd
from sgl.engine.sync_engine import Engine
from sgl.runtime.tokenizer_manager import EngineDeadError, ServerBusyError

__all__ = ["AsyncEngine", "AttachedEngine", "Engine", "EngineDeadError", "EngineFrontEnd", "ServerBusyError"]
