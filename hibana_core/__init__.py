"""Hibana's engine: works on token ids and knows nothing of any agent framework."""

from hibana_core.config import CacheConfig, EngineConfig, SamplingParams, SchedulerConfig
from hibana_core.errors import (CheckpointError, ConfigError, ContextLengthError, EngineClosedError,
                                GrammarError, HibanaError, InvalidTokenError, MemoryBudgetError,
                                StateBusyError, StateClosedError, StateExistsError, StateFileError,
                                SurgeryGuardError, UnsupportedModelError)
from hibana_core.state import Completion, RequestStats, StateHandle, StateInfo, StreamEvent, SyncStats


def __getattr__(name: str):
    # the Engine pulls in torch and the model code: import it on first use
    if name in ("Engine", "EngineStats"):
        from hibana_core import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'hibana_core' has no attribute {name!r}")


__all__ = [
    "CacheConfig", "CheckpointError", "Completion", "ConfigError", "ContextLengthError", "Engine",
    "EngineClosedError", "EngineConfig", "EngineStats", "GrammarError", "HibanaError", "InvalidTokenError",
    "MemoryBudgetError", "RequestStats", "SamplingParams", "SchedulerConfig",
    "StateBusyError", "StateClosedError", "StateExistsError", "StateFileError", "StateHandle",
    "StateInfo", "StreamEvent", "SurgeryGuardError", "SyncStats", "UnsupportedModelError",
]
