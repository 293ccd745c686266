"""What both framework adapters share: their options (sampling names, the peers' aliases, strict
checks), the engine an adapter object runs on (`EngineChoice`), and the wait of an async call for
a state that a stream its consumer left still holds (`lease_holder`).

An adapter's constructor and its calls accept only the options it knows. An unknown or misspelt
one raises a `ConfigError` that names it and lists the accepted ones: a local engine has no
remote API to pass an option on to, so an option it does not know can only be a mistake
(`ChatHibana(temperatur=0.7)` would otherwise sample greedily without a word). Options of peers
that mean nothing for an engine in the process (`keep_alive`: the model stays loaded as long as
the engine; `api_key`, `base_url`) are dropped with a warning, so that code written for
ChatOllama or ChatOpenAI runs unchanged (LangChain's own standard tests pass `api_key`).

The peers' names for the same thing are accepted as aliases (`ALIASES`); giving both an alias and
its name with different values is an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import difflib
import os
import threading
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from hibana_core.config import EngineConfig, SamplingParams
from hibana_core.errors import ConfigError
from hibana_core.speculation.speculator import check_method
from hibana_plugins.manager import get_plugin_manager

SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty",
            "presence_penalty", "frequency_penalty", "logit_bias", "stop", "logprobs", "top_logprobs",
            "speculation")
"""The SamplingParams fields an adapter takes on the object and per call, under the same names."""

ALIASES = {"num_predict": "max_tokens", "repeat_penalty": "repetition_penalty", "num_ctx": "max_model_len",
           "context_window": "max_model_len", "request_timeout": "timeout"}
"""Ollama's / llama.cpp's names (LlamaIndex's Ollama: context_window, request_timeout; also
ChatOpenAI's request_timeout) -> Hibana's. `max_model_len` is an engine option (engine_kwargs)."""

ENGINE_OPTIONS = frozenset({"max_model_len"})
"""Aliased names that go to the engine rather than to sampling (constructor only)."""

IGNORED = {"keep_alive": "the model stays loaded as long as its engine lives",
           "api_key": "a local engine has no API to authenticate to",
           "base_url": "the engine runs in this process; for a server use `hibana serve` and an OpenAI client",
           "stream_usage": "usage always comes on a stream's last chunk"}
"""Peers' options that mean nothing for an engine in the process: dropped with a warning."""

_JSON_OUTPUT = {"ChatHibana": "for JSON output use with_structured_output(schema, method='json_mode' or 'json_schema'), "
                              "or response_format= on a call",
                "HibanaLLM": "for JSON output use structured_predict, or json_schema= on a call"}
HINTS = {"format": _JSON_OUTPUT,
         "response_format": "for JSON output use ChatHibana's with_structured_output(schema, method='json_schema'), "
                            "or HibanaLLM's structured_predict or json_schema= on a call",
         "json_mode": _JSON_OUTPUT,
         "thinking": "reasoning=True / False switches a reasoning model's thinking",
         "is_function_calling_model": "it is read from the chat template (metadata.is_function_calling_model)",
         "strict": "tool arguments and structured answers are held to their schema by the grammar, as OpenAI's "
                   "strict=True holds them; drop it",
         "model_kwargs": "pass each option by its own name",
         "additional_kwargs": "pass each option by its own name",
         "generate_kwargs": "pass each sampling option by its own name (temperature=..., max_tokens=...)",
         "max_model_len": "the engine's context, fixed when it loads: give num_ctx or context_window to the "
                          "constructor, or engine_kwargs={'max_model_len': ...}"}
"""What to do instead, for options a user of a peer is likely to try (by adapter, where its own
methods differ)."""


def unset_nones(options: Mapping[str, Any]) -> dict[str, Any]:
    """`options` without the sampling options given as None, which a constructor then sets to
    their defaults, as None does per call (ChatOpenAI's and ChatOllama's None is the API's default
    too); max_tokens keeps its None, which means no limit but the context."""
    return {k: v for k, v in options.items() if v is not None or k not in SAMPLING or k == "max_tokens"}


def resolve_aliases(options: Mapping[str, Any], where: str) -> dict[str, Any]:
    """`options` with the peers' names (`ALIASES`) renamed to Hibana's and the ignored ones
    (`IGNORED`) dropped with a warning. An alias beside its own name, with another value, is
    refused."""
    out = {k: v for k, v in options.items() if k not in ALIASES and k not in IGNORED}
    for name, value in options.items():
        if name in IGNORED:
            warnings.warn(f"{where}: {name!r} is ignored ({IGNORED[name]})", stacklevel=4)
        elif name in ALIASES:
            own = ALIASES[name]
            if own in out and out[own] != value:
                raise ConfigError(f"{where}: {name}={value!r} and {own}={out[own]!r} name the same option; "
                                  f"give one ({name} is an alias of {own})")
            out[own] = value
    return out


def check_known(options: Iterable[str], accepted: Iterable[str], where: str) -> None:
    """ConfigError naming the options outside `accepted` (with a close match or a hint where
    there is one) and listing the accepted ones."""
    accepted = sorted(set(accepted))
    unknown = [name for name in options if name not in accepted]
    if not unknown:
        return
    notes = []
    for name in unknown:
        close = difflib.get_close_matches(name, accepted, n=1)
        hint = HINTS.get(name)
        if isinstance(hint, dict):  # ChatHibana's JSON output is with_structured_output, HibanaLLM's structured_predict
            hint = hint["HibanaLLM" if "HibanaLLM" in where else "ChatHibana"]
        note = hint or _engine_hint(name) or (f"did you mean {close[0]!r}?" if close else "")
        given = [alias for alias, own in ALIASES.items() if own == name]  # (the caller may have written one)
        note = f"{name} is what {' and '.join(given)} mean" + (f": {note}" if note else "") if given else note
        notes.append(f"{name!r}" + (f" ({note})" if note else ""))
    raise ConfigError(f"{where} does not take {', '.join(notes)}; it accepts "
                      f"{', '.join(accepted)} (aliases: {', '.join(f'{a}={n}' for a, n in ALIASES.items())})")


def _engine_hint(name: str) -> str:
    """Where an engine option goes when given to an adapter (`ChatHibana(surgery=...)`)."""
    if name not in EngineConfig.option_names():
        return ""
    return f"an engine option, fixed when the engine loads: give the constructor engine_kwargs={{{name!r}: ...}}"


def check_state_id(values: Mapping[str, Any], where: str) -> None:
    """An adapter's bound `state_id` checked when the object is made (an empty one failed only on
    the first call)."""
    if values.get("state_id") is not None:
        from hibana_core.registry import check_id  # (it brings torch, which importing an adapter must not)

        try:
            check_id(values["state_id"])
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None


SWITCHES = ("logprobs", "streaming", "reasoning", "guided_tool_arguments", "clean_tool_schemas")
"""Adapter options that are True or False (None: the default) as given: pydantic reads "yes", "no", 1 and 0
as switches."""


def check_switches(values: Mapping[str, Any], where: str) -> None:
    """An adapter's true-or-false options, its reasoning options together and its timeout, checked
    when the object is made (reasoning_effort "none" beside reasoning=True, and ChatHibana's timeout
    of 0, -1 or NaN, failed only on the first call; pydantic read True as a timeout of 1 s)."""
    for name in SWITCHES:
        if values.get(name) is not None and not isinstance(values[name], bool):
            raise ConfigError(f"{where}: {name} must be True or False, got {values[name]!r:.40}")
    timeout = values.get("timeout")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not timeout > 0):
        raise ConfigError(f"{where}: timeout must be a number of seconds > 0, or None; got {timeout!r:.40}")
    effort = values.get("reasoning_effort")
    if effort is not None and not isinstance(effort, str):
        raise ConfigError(f"{where}: reasoning_effort must be a level (a string) or None, got {effort!r:.40}")
    if effort == "none" and values.get("reasoning") is True:
        raise ConfigError(f"{where}: reasoning_effort 'none' and reasoning=True disagree; give one of them")


def sampling_params(values: Mapping[str, Any], where: str, context: int | None = None) -> SamplingParams:
    """SamplingParams from an adapter's sampling options (`SAMPLING` names; None: the default),
    its errors saying where the value came from; a speculation method must name a registered
    drafter. With the model's `context` known, max_tokens None means no limit but the context
    (ChatOpenAI's None), rather than SamplingParams' default."""
    given = {name: values[name] for name in SAMPLING if values.get(name) is not None}
    if context is not None and values.get("max_tokens") is None:
        given["max_tokens"] = context
    if "stop" in given and isinstance(given["stop"], str):
        given["stop"] = [given["stop"]]
    try:
        if given.get("max_tokens") == 0:  # the server and HibanaLLM refuse it too: one rule for every adapter
            raise ConfigError("max_tokens must be at least 1: a reply of no tokens says nothing (to fill a "
                              "state with a prompt, use StateHandle.sync)")
        params = SamplingParams(**given)
        if params.speculation is not None:  # a drafter's name too, before any engine is loaded
            check_method(params.speculation, list(get_plugin_manager().drafters()))
    except ConfigError as exc:
        raise type(exc)(f"{where}: {exc}") from None
    return params


# --- the engine an adapter object runs on ----------------------------------------------------------

@dataclass(frozen=True, eq=False)
class EngineChoice:
    """An engine and the adapter options it was chosen for: an object runs on it while its `model`
    and `engine_kwargs` are these. Pydantic copies an object's private attributes into its copies,
    so a copy given another model (`model_copy(update=...)`) would otherwise keep the first one's
    engine."""

    engine: Any
    model: str
    engine_kwargs: dict

    def serves(self, model: str, engine_kwargs: Mapping[str, Any]) -> bool:
        return self.model == model and self.engine_kwargs == engine_kwargs


def check_engine_kwargs(model: Any, engine_kwargs: Mapping[str, Any]) -> None:
    """A ConfigError now, where `engine_kwargs` would make no engine config (an unknown option, a
    value out of range): an adapter checks them when made, not when its first call loads the engine."""
    if not isinstance(engine_kwargs, Mapping):  # (a TypeError of the ** below)
        raise ConfigError(f"engine_kwargs is a dict of engine options (engine_kwargs={{'surgery': ['w8']}}), got "
                          f"{type(engine_kwargs).__name__} {engine_kwargs!r:.60}")
    EngineConfig.from_overrides(str(model), **engine_kwargs)


def check_engine(engine: Any, who: str) -> None:
    """A ConfigError where `engine=` is no engine: a model's name there (`engine="demo"`) was an
    AttributeError of its `.config`."""
    if engine is None or (hasattr(engine, "config") and hasattr(engine, "open_state")):
        return
    hint = (f"; to load a model by name or path, pass model={os.fspath(engine)!r:.60}"
            if isinstance(engine, (str, os.PathLike)) else "")
    raise ConfigError(f"{who}: engine= takes a loaded hibana_core Engine (Engine.from_pretrained(...)), got "
                      f"{type(engine).__name__} {engine!r:.60}{hint}")


def check_given_engine(engine: Any, engine_kwargs: Mapping[str, Any], who: str) -> None:
    """A ConfigError where an adapter is given an engine (`engine=`) and engine options that the
    engine was not loaded with (`context_window=`, `num_ctx=`, `engine_kwargs=`): they would be
    ignored, the engine's own serving every call. Options equal to the engine's pass, and so do
    those equal to what it resolved (a context the model's own length, the device and dtype of
    "auto")."""
    if not engine_kwargs:
        return
    from hibana_core.config import FP8_KV_DTYPES, OPTION_ALIASES

    wanted = EngineConfig.from_overrides(str(engine.config.model), **engine_kwargs)

    def option(config: EngineConfig, key: str) -> Any:
        key = OPTION_ALIASES.get(key, key)
        for part in (config, config.cache, config.scheduler):
            if key in {f.name for f in dataclasses.fields(part)}:
                return getattr(part, key)
        return None

    def runs_with(key: str) -> list[Any]:
        """What the engine resolved an option left open (None, "auto") to: a context of the
        model's own length is the one asked for, whether or not the engine was given it."""
        key = OPTION_ALIASES.get(key, key)
        if key == "max_model_len":
            return [getattr(engine, "max_model_len", None)]
        if key == "dtype":  # a torch.dtype
            return [str(getattr(engine, "dtype", "")).removeprefix("torch.")]
        if key == "kv_dtype":  # the cache's own ("fp8" is float8_e4m3fn's other name)
            kv = str(getattr(getattr(engine, "kv_cache", None), "dtype", "")).removeprefix("torch.")
            return list(FP8_KV_DTYPES) if kv in FP8_KV_DTYPES else [kv]
        device = getattr(engine, "device", None)
        if key == "device" and device is not None:
            return [str(device), *([device.type] if getattr(device, "index", None) in (None, 0) else [])]
        return []

    differ = [key for key in engine_kwargs if option(wanted, key) != option(engine.config, key)
              and option(wanted, key) not in runs_with(key)]
    if differ:
        raise ConfigError(f"{who}: the engine passed (engine=) was loaded with other {', '.join(differ)} than "
                          f"asked here ({', '.join(f'{k}={engine_kwargs[k]!r}' for k in differ)}), which it would "
                          f"ignore; load it with them (Engine.from_pretrained(..., {differ[0]}=...)) or leave "
                          "them out")


def choose_engine(model: str, engine_kwargs: Mapping[str, Any], current: EngineChoice | None,
                  given: EngineChoice | None) -> EngineChoice:
    """The engine in use (`current`) or the one passed (`given`), the first that serves `model` and
    `engine_kwargs`, else the engine `Engine.shared(model, **engine_kwargs)` loads or finds. A shared
    engine closed meanwhile is not kept: the object finds the new one, as an object made now does
    (it kept the closed one, and every call said to create an engine with Engine.from_pretrained);
    an engine passed and closed stays the object's engine (its calls say it is closed)."""
    for choice in (current, given):
        if choice is not None and choice.serves(model, engine_kwargs) and (
                choice is given or not choice.engine.core.closed):
            return choice
    from hibana_core import Engine  # the engine, torch with it, loads on first use

    return EngineChoice(Engine.shared(model, **engine_kwargs), model, dict(engine_kwargs))


def sharing(memo: dict[int, Any] | None, *shared: Any) -> dict[int, Any]:
    """A `copy.deepcopy` memo in which `shared` (an engine, its chat layer) are copied as
    themselves: an adapter's deep copy runs on the same engine."""
    memo = {} if memo is None else memo
    memo.update({id(obj): obj for obj in shared if obj is not None})
    return memo


# --- async calls on a state that a stream their consumer left still holds -------------------------

RELEASE_WAIT = 2.0
"""Seconds an async call waits for a state that a call whose consumer is gone still holds (a
stream closed early, or a call of a task now done): its lease is let go in a worker thread once
the stream is closed. Without the wait the next call of the same agent found its state busy
(StateBusyError, or another state)."""

CLOSING_WAIT = 0.25
"""Seconds an async call waits for a stream of its own task that holds its state to be closed: one
left by `break` is closed by the event loop's finalizer a few loop turns later (a turn or two per
framework generator around it). One still open after that is in use: its state is busy."""

_holders: dict[tuple[int, str], "LeaseHolder"] = {}
"""The async call holding each state, by (id(engine), state id), from its lease until it is let go."""
_holders_lock = threading.Lock()  # leases are taken and let go in worker threads


class LeaseHolder:
    """An async adapter call's note of the state it leased, kept until the lease is let go, so
    that a later call on that state whose consumer is gone is waited for (`lease_holder`). Sync
    calls keep none: a sync stream left early is closed at once."""

    def __init__(self, engine: Any, task: asyncio.Task | None, state_id: str | None = None,
                 step: Any = None) -> None:
        self.engine, self.task, self.state_id = engine, task, state_id
        self.step = step
        """The graph step that made the call (LangGraph's checkpoint it runs from), where known."""
        self.key: tuple[int, str] | None = None
        self.left = False
        """Set by the adapter's stream when it is closed before its end: the release is on its way."""

    def open(self, open_turn: Callable[[contextlib.ExitStack], Any], stack: contextlib.ExitStack) -> Any:
        """`open_turn(stack)` (a `turn.Open`), noting the state it leased until the lease is let go.
        The state the call names is noted before its lease, where no other call's note is: the
        turn is still being set up under the lease (a tool set's grammar built), and a call that
        its task's cancellation ended there was not waited for."""
        stack.callback(self._let_go)  # entered before the lease: called after the lease is let go
        if self.state_id is not None:
            with _holders_lock:
                named = (id(self.engine), self.state_id)
                if named not in _holders:  # another call's note stays while that call holds the state
                    self.key = named
                    _holders[named] = self
        run, handle = open_turn(stack)
        with _holders_lock:
            self._let_go_locked()  # the named state's note, where another state serves the call
            self.key = (id(self.engine), handle.id)
            _holders[self.key] = self
        return run, handle

    def gone_for(self, task: asyncio.Task | None, waited: float, step: Any = None) -> bool:
        """Whether this call's consumer is gone, for a call of `task` (made by graph step `step`)
        that has waited `waited` seconds: its stream was left, or its task is done or being
        cancelled (its call ends, and lets the state go, a few loop turns later), or it was made by
        another step of the graph thread whose state it holds (one run's steps never overlap: its
        run was cancelled or left, and LangGraph cancels its node a few loop turns later, after the
        next run may have begun); a call of `task` itself, busy with another call now, is given
        CLOSING_WAIT for its stream to be closed."""
        done = self.task is not None and (self.task.done() or _cancelling(self.task))
        moved_on = step is not None and self.step is not None and step != self.step
        return self.left or done or moved_on or (self.task is task and waited < CLOSING_WAIT)

    def _let_go(self) -> None:
        with _holders_lock:
            self._let_go_locked()

    def _let_go_locked(self) -> None:
        if self.key is not None and _holders.get(self.key) is self:
            del _holders[self.key]


def _cancelling(task: asyncio.Task) -> bool:
    """Whether `task` was asked to stop and has not yet (Python 3.11's `Task.cancelling`; on 3.10,
    which does not count cancellations, only a task done is gone)."""
    cancelling = getattr(task, "cancelling", None)
    return cancelling is not None and cancelling() > 0


async def lease_holder(engine: Any, state_id: str | None, task: asyncio.Task | None = None,
                       step: Any = None) -> LeaseHolder:
    """The note for an async call on `state_id` of `engine` made by `task` (None: the current
    one) in graph step `step` (where known: `LeaseHolder.step`), once no call whose consumer is
    gone (`LeaseHolder.gone_for`) holds that state, or after
    RELEASE_WAIT seconds. A state held by a call that is still read (another task's, or a stream
    still open) is not waited for: concurrent calls on one state are refused, or served by another
    state, as they were."""
    task = asyncio.current_task() if task is None else task
    loop = asyncio.get_running_loop()
    start = loop.time()
    while state_id is not None:
        holder = _holders.get((id(engine), state_id))
        waited = loop.time() - start
        if holder is None or waited >= RELEASE_WAIT or not holder.gone_for(task, waited, step):
            break
        await asyncio.sleep(0.005)
    return LeaseHolder(engine, task, state_id, step)
