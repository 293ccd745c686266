"""Every failure a user can cause is a `HibanaError` whose message says what to do."""

from __future__ import annotations

# The base class lives in the plugin contract (a leaf) so that the plugin manager can subclass it
# without loading the engine.
from hibana_plugins.hookspecs import HibanaError
# Raised by the plugin manager (a leaf too) and re-exported so that every HibanaError a caller can
# meet is importable from `hibana_core`.
from hibana_plugins.manager import PluginError

__all__ = [
    "ChatTimeoutError", "CheckpointError", "ConfigError", "ContextLengthError", "ConversationError",
    "EngineClosedError", "GrammarError", "HibanaError", "InvalidTokenError", "MemoryBudgetError",
    "MissingDependencyError", "PluginError", "PromptMarkupError", "QueueTimeoutError", "StateBusyError",
    "StateClosedError", "StateExistsError", "StateFileError", "SurgeryGuardError", "ToolChoiceError", "ToolSchemaError",
    "UnsupportedContentError", "UnsupportedModelError",
]


def hibana_error(exc: Exception, failed: str) -> HibanaError:
    """`exc` where it is a HibanaError (it says what to do), else one saying what `failed`, and why."""
    return exc if isinstance(exc, HibanaError) else HibanaError(f"{failed}: {exc!r}")


class ConfigError(HibanaError, ValueError):
    """A configuration or sampling parameter is out of range."""


class GrammarError(ConfigError):
    """A request's JSON schema, regex or grammar cannot be compiled (or the model's output cannot
    continue it); only that request fails."""


class UnsupportedModelError(HibanaError):
    """The checkpoint's architecture has no registered model family."""


class CheckpointError(HibanaError):
    """The checkpoint directory is missing, incomplete or damaged."""


class ContextLengthError(HibanaError, ValueError):
    """A history is longer than the model's context window; the state is left unchanged."""


class InvalidTokenError(HibanaError, ValueError):
    """A token id lies outside the model's vocabulary. `field`: the request field that held it
    (None: the prompt or history)."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class StateClosedError(HibanaError):
    """The state handle was closed (or its engine was)."""


class StateBusyError(HibanaError):
    """The state is busy with a request (a generation, or a sync's prefill); edits must wait until it ends."""


class StateFileError(HibanaError):
    """A saved state file is damaged or was written for another model or tokenizer."""


class MemoryBudgetError(HibanaError):
    """The memory budget cannot hold the weights, or the KV blocks a request needs."""


class EngineClosedError(HibanaError):
    """The engine was closed."""


class StateExistsError(HibanaError):
    """A state with that id is already open."""


class SurgeryGuardError(HibanaError):
    """A model surgery pass costs more quality than its floor allows (measured by the guard
    against the unmodified model); the message has the figures and how to force it."""


class QueueTimeoutError(HibanaError, TimeoutError):
    """A request waited for admission longer than `queue_timeout_ms` (more requests than
    `max_concurrent_agents`, or no KV room). Nothing was computed for it; its state holds the
    history it was called with, so calling again costs nothing extra. Also a TimeoutError."""


class ChatTimeoutError(HibanaError, TimeoutError):
    """A call ran past its timeout; its state is left as it was before the call. Also a builtin
    TimeoutError, so `except TimeoutError` catches it."""


class MissingDependencyError(HibanaError, ImportError):
    """An adapter whose framework is not installed (`ChatHibana` without langchain-core,
    `HibanaLLM` without llama-index-core); the message has the pip command. Also a builtin
    ImportError, so `except ImportError` catches it."""


class ConversationError(HibanaError, ValueError):
    """A conversation that cannot be rendered faithfully: a tool result answering no call, a
    message that is not a message, a role the chat template drops, text that is not Unicode."""


class UnsupportedContentError(HibanaError, ValueError):
    """A message carries content the model cannot read (an image, audio, a file)."""


class ToolSchemaError(HibanaError, ValueError):
    """A tool that is not an OpenAI function tool: no name, parameters that are not a schema."""


class ToolChoiceError(HibanaError, ValueError):
    """A tool_choice that names no offered tool, or requires a call with no tools offered."""


class PromptMarkupError(HibanaError, ValueError):
    """The chat template transforms message contents in a way that hides where they are."""
