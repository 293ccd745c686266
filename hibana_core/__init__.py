"""Hibana's engine: works on token ids and knows nothing of any agent framework.

Hibana logs under the `hibana` logger (`hibana.load`, `hibana.engine`, `hibana.hub`,
`hibana.states`, `hibana.requests`): load times, which state served a call, tokens reused and
computed, evictions. A library stays silent until its user configures logging, so the logger
has only a NullHandler; e.g. `logging.basicConfig(); logging.getLogger("hibana").setLevel("INFO")`.
"""

import importlib.metadata as _metadata
import logging as _logging

from hibana_core.config import CacheConfig, EngineConfig, SamplingParams, SchedulerConfig
from hibana_core.errors import (ChatTimeoutError, CheckpointError, ConfigError, ContextLengthError, ConversationError,
                                EngineClosedError, GrammarError, HibanaError, InvalidTokenError, MemoryBudgetError,
                                MissingDependencyError, PluginError, PromptMarkupError, QueueTimeoutError,
                                StateBusyError, StateClosedError, StateExistsError, StateFileError, SurgeryGuardError,
                                ToolChoiceError, ToolSchemaError, UnsupportedContentError, UnsupportedModelError)
from hibana_core.state import (Completion, RequestStats, StateHandle, StateInfo, StreamEvent, SyncStats,
                                TokenLogprob)

_logging.getLogger("hibana").addHandler(_logging.NullHandler())

try:
    __version__ = _metadata.version("hibana")
except _metadata.PackageNotFoundError:  # a checkout on PYTHONPATH, not installed
    __version__ = "unknown"


def __getattr__(name: str):
    # the Engine pulls in torch and the model code: import it on first use
    if name in ("Engine", "EngineStats"):
        from hibana_core import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'hibana_core' has no attribute {name!r}")


__all__ = [
    "CacheConfig", "ChatTimeoutError", "CheckpointError", "Completion", "ConfigError", "ContextLengthError",
    "ConversationError", "Engine", "EngineClosedError", "EngineConfig", "EngineStats", "GrammarError", "HibanaError",
    "InvalidTokenError", "MemoryBudgetError", "MissingDependencyError", "PluginError", "PromptMarkupError",
    "QueueTimeoutError", "RequestStats", "SamplingParams", "SchedulerConfig", "StateBusyError", "StateClosedError",
    "StateExistsError", "StateFileError",
    "StateHandle", "TokenLogprob", "StateInfo", "StreamEvent", "SurgeryGuardError", "SyncStats", "ToolChoiceError",
    "ToolSchemaError", "UnsupportedContentError", "UnsupportedModelError",
]
