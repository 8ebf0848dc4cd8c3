"""sgl.testing: a kit for testing apps that embed sgl, without a GPU or weights
(docs/testing.md).

- `FakeEngine` / `FakeSyncEngine`: the engines' public surface and rules, no model;
  `VirtualTimeLoop` / `run_virtual` run them on virtual time.
- Faults on demand (`FaultPlan` with effects and selectors): a FakeEngine obeys one;
  `inject_faults` installs one on a real engine.
- A real engine on the public null model that starts in about a second (`null_engine`,
  `null_sync_engine`, `null_model_dir`, `null_continuation`), its forwards taking a
  device's time if asked (`DeviceTime`).
- The engine's contract as a checker (`check_result`, `check_stream`, `assert_no_leaks`,
  `assert_engine_clean`).
- Hypothesis strategies in `sgl.testing.strategies` (imported on its own: it needs
  hypothesis), and a pytest plugin (`sgl.testing.plugin`, registered as `sgl`).

Importing this package, and everything in it but a real engine, imports neither torch
nor transformers."""

from sgl.testing.contract import (
    RULES,
    Contract,
    ContractViolation,
    EngineFacts,
    GenerateRequest,
    assert_engine_clean,
    assert_no_leaks,
    check_result,
    check_stream,
    tokenizer_decoder,
)
from sgl.testing.engines import (
    BackgroundEngine,
    DeviceTime,
    EngineRecipe,
    ServedApp,
    null_continuation,
    null_engine,
    null_model_dir,
    null_sync_engine,
    server_info_when_idle,
)
from sgl.testing.fake import FakeEngine, FakeSyncEngine, FakeTokenizer, Responder, VirtualTimeLoop, run_virtual
from sgl.testing.faults import (
    Abort,
    Always,
    Busy,
    Control,
    Die,
    Fail,
    Fault,
    FaultPlan,
    Hang,
    Nth,
    Rid,
    SlowFirstToken,
    Where,
    inject_faults,
)

__all__ = [
    "RULES", "Abort", "Always", "BackgroundEngine", "Busy", "Contract", "ContractViolation", "Control",
    "DeviceTime", "Die", "EngineFacts", "EngineRecipe", "Fail", "FakeEngine", "FakeSyncEngine", "FakeTokenizer",
    "Fault", "FaultPlan",
    "GenerateRequest", "Hang", "Nth", "Responder", "Rid", "ServedApp", "SlowFirstToken", "VirtualTimeLoop", "Where",
    "assert_engine_clean", "assert_no_leaks", "check_result", "check_stream", "inject_faults", "null_continuation",
    "null_engine", "null_model_dir", "null_sync_engine", "run_virtual", "server_info_when_idle", "tokenizer_decoder",
]
