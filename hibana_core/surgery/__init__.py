"""Model surgery: load-time rewrites that cut the bytes each token reads.

    checkpoint -> weights copied (shapes checked) -> passes, in order -> the engine's model
                                                     |
                                       each pass returns a record: what it changed, bytes before
                                       and after; the records join the model fingerprint

A pass is an object with `apply(model, params) -> dict`, registered by name through the
`register_surgery_passes` hook (`hibana_core.surgery.passes` registers the built-in ones). The
engine takes them as `surgery=["w8"]` or `surgery=[{"name": "w4", "group_size": 64}]`. A pass
that must run the model on text (kv8) sets `calibrated = True` and gets a third argument, a
`calibration.Calibration`. A record's "digest", when a pass derived values from data (kv8's
scales), joins the fingerprint with the pass's name and parameters. A pass shows its work through
`progress_bar`, which the engine's `progress=False` silences.
"""

from __future__ import annotations

import contextvars
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, Sequence

from hibana_core.errors import ConfigError, HibanaError
from hibana_plugins.manager import accepts, describe_registered

if TYPE_CHECKING:  # torch stays unimported until a model is built (adapters import this module)
    import torch

_PROGRESS: contextvars.ContextVar[bool] = contextvars.ContextVar("hibana_surgery_progress", default=True)


def progress_bar(iterable: Any, **tqdm_args: Any) -> Any:
    """`tqdm(iterable, **tqdm_args)` for a pass's work, hidden while the passes run under an
    engine started with `progress=False` (the pass interface stays `apply(model, params)`)."""
    from hibana_core.progress import bar

    disable = tqdm_args.pop("disable", False) or not _PROGRESS.get()
    return bar(iterable, disable=disable, **tqdm_args)


class SurgeryPass(Protocol):
    def apply(self, model: "torch.nn.Module", params: dict[str, Any]) -> dict[str, Any]:
        """Rewrite `model` in place; return a JSON-able record of what changed. Raise a
        ConfigError for parameters it cannot take."""
        ...

    # Optional: `check(params) -> dict`, the parameters with their defaults filled in, or a
    # ConfigError, before the model loads (a pass without it gets its parameters as given).
    # Optional: `refuse(model, params)`, a ConfigError where the pass cannot apply to the model as
    # loaded (already quantized, no layer it takes), changing nothing: every pass's runs before
    # the guard measures the unmodified model, which takes minutes on a large model on a CPU.
    # Optional: `rewrites`, a str naming what the pass rewrites ("the linear weights"): two passes
    # of one list that rewrite the same thing are refused before the model loads.
    # Optional: `guard_reach(params) -> int`, the tokens at the start of a text within which the
    # pass changes nothing (a window's span): the guard scores documents that run past it, and
    # refuses the pass unless forced where the model's positions or the text cannot.


@dataclass(frozen=True)
class PassRequest:
    name: str
    params: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, value: Any) -> "PassRequest":
        if isinstance(value, PassRequest):
            return value
        if isinstance(value, str) and value:
            return cls(value)
        if isinstance(value, dict) and isinstance(value.get("name"), str):
            params = {k: v for k, v in value.items() if k != "name"}
            try:  # named by strings (a pass sorts and compares its parameters' names)
                plain = all(isinstance(k, str) for k in params) and bool(json.dumps(params))
            except (TypeError, ValueError):
                plain = False
            if not plain:
                raise ConfigError(f"surgery pass {value['name']!r}: parameters must be plain data named by "
                                  f"strings, got {params!r}")
            return cls(value["name"], params)
        raise ConfigError(f"a surgery pass is a name or {{'name': ..., parameters}}, got {value!r}; "
                          "e.g. surgery=['w8'] or surgery=[{'name': 'w4', 'group_size': 64}]")


def parse_passes(value: Any) -> tuple[PassRequest, ...]:
    """`surgery=` as given (None, a name, or a list of names and dicts) -> the requests, in order."""
    if value is None:
        return ()
    if isinstance(value, (str, dict, PassRequest)):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"surgery must be a list of pass names, got {value!r}; e.g. surgery=['w8']")
    requests = tuple(PassRequest.parse(v) for v in value)
    names = [r.name for r in requests]
    if len(set(names)) != len(names):
        raise ConfigError(f"surgery names a pass twice ({names}); give each pass once")
    return requests


def check_requests(requests: Sequence[PassRequest], passes: dict[str, Any]) -> tuple[PassRequest, ...]:
    """The requests with each pass's defaults filled in, or a ConfigError for a name that no
    registered pass has (listing those that are) or for parameters its pass cannot take: what
    can be known before the model loads and the guard runs."""
    checked = []
    for request in requests:
        if request.name not in passes:
            names = [n.strip() for n in request.name.split(",")]
            if len(names) > 1 and all(n in passes for n in names):  # the CLI's spelling
                # the list as JSON: Python reads it, and so does `hibana serve --option surgery=...`
                raise ConfigError(f"surgery={request.name!r} is one name; give a list: surgery={json.dumps(names)}")
            raise ConfigError(f"no surgery pass named {request.name!r} is registered (registered: "
                              f"{', '.join(sorted(passes)) or 'none'}); install the plugin that provides it")
        _check_registered(request.name, passes[request.name])
        params = dict(request.params)
        force = params.pop("force", False)
        if not isinstance(force, bool):
            raise ConfigError(f"surgery pass {request.name!r}: force must be true or false, got {force!r}")
        check = getattr(passes[request.name], "check", None)
        if check is not None:
            params = dict(check(params))
        checked.append(PassRequest(request.name, {**params, **({"force": True} if force else {})}))
    rewrites = [(r.name, getattr(passes[r.name], "rewrites", None)) for r in checked]
    for i, (name, what) in enumerate(rewrites):
        clash = [other for other, theirs in rewrites[:i] if what is not None and theirs == what]
        if clash:  # the second would refuse only after the guard measured the first
            raise ConfigError(f"surgery passes {clash[0]!r} and {name!r} both rewrite {what}; give one of them")
    return tuple(checked)


def _check_registered(name: str, surgery_pass: Any) -> None:
    """A ConfigError, before the model loads, unless a plugin registered a pass object whose apply
    takes what it will be given: a class registered in place of its instance would be called with
    the model as `self`, and an apply of another signature would fail after the model loaded."""
    if isinstance(surgery_pass, type):
        raise ConfigError(f"surgery pass {name!r} is registered as {describe_registered(surgery_pass)}, not an "
                          f"instance of it; register the pass object: register({name!r}, "
                          f"{surgery_pass.__name__}())")
    if not callable(getattr(surgery_pass, "apply", None)):
        raise ConfigError(f"surgery pass {name!r} is registered as {describe_registered(surgery_pass)}, which has "
                          "no apply(model, params) method; register an object with apply(model, params) -> dict")
    if getattr(surgery_pass, "calibrated", False):
        shape, args = "apply(model, params, calibration) (its calibrated = True adds the calibration)", (None, {}, None)
    else:
        shape, args = "apply(model, params)", (None, {})
    if not accepts(surgery_pass.apply, *args):
        raise ConfigError(f"surgery pass {name!r} ({describe_registered(surgery_pass)}) has an apply that cannot "
                          f"be called as {shape}; give it that signature")


def apply_passes(model: "torch.nn.Module", requests: Sequence[PassRequest], passes: dict[str, Any],
                 guard: Any = None, calibration: Any = None, progress: bool = True,
                 applied: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Run the passes in order; their records, each with its name and parameters (and, with a
    guard, its figures against the unmodified model, and a later pass's own cost: a pass
    whose own cost is over its floors raises SurgeryGuardError unless its request says
    `force: True`). `calibration`: what passes with
    `calibrated = True` run the model on; `progress`: whether their `progress_bar`s show;
    `applied`: the passes a surgery checkpoint was written with (each applies once)."""
    token = _PROGRESS.set(progress)
    try:
        return _apply(model, requests, passes, guard, calibration, applied)
    finally:
        _PROGRESS.reset(token)


def _apply(model: "torch.nn.Module", requests: Sequence[PassRequest], passes: dict[str, Any],
           guard: Any, calibration: Any, applied: Sequence[str] = ()) -> list[dict[str, Any]]:
    records = []
    runs = []  # (request, its parameters, force) for every request before any pass runs
    for request in check_requests(requests, passes):
        params = dict(request.params)
        runs.append((request, params, params.pop("force", False)))
    for request, params, _ in runs:  # whether each applies to the model as loaded, before the guard's reference
        if callable(getattr(passes[request.name], "refuse", None)):
            _run(request.name, passes[request.name], "refuse", model, dict(params))
    again = [request.name for request, _, _ in runs if request.name in applied]  # where no refuse said so
    if again:
        raise ConfigError(f"the checkpoint was written with {', '.join(map(repr, again))} applied already (its "
                          f"surgery manifest: {list(applied)}); each pass applies once: leave "
                          f"{'it' if len(again) == 1 else 'them'} out of surgery")
    if guard is not None:
        guard.measure_reference()
    for i, (request, params, force) in enumerate(runs):
        surgery_pass = passes[request.name]
        extra = ()
        if getattr(surgery_pass, "calibrated", False):
            if calibration is None:
                raise ConfigError(f"surgery pass {request.name!r} runs the model on calibration text; "
                                  "apply it through the engine (Engine.from_pretrained(..., surgery=[...]))")
            extra = (calibration,)
        changed = _run(request.name, surgery_pass, "apply", model, params, *extra)
        if not isinstance(changed, Mapping):
            raise ConfigError(f"surgery pass {request.name!r} ({describe_registered(surgery_pass)}) returned "
                              f"{changed!r} from apply; apply(model, params) must return a dict, a JSON-able "
                              "record of what it changed ({} when nothing): fix the pass, or leave it out of surgery")
        try:  # the record goes in a written checkpoint's manifest
            json.dumps(dict(changed), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"surgery pass {request.name!r} ({describe_registered(surgery_pass)}) returned a "
                              f"record that is not JSON ({exc}); apply(model, params) must return a JSON-able "
                              "record (numbers, strings, lists, dicts): fix the pass, or leave it out of "
                              "surgery") from None
        record = {"name": request.name, "params": dict(params), **changed}
        if guard is not None:
            record["guard"] = guard.check(request.name, surgery_pass, force,
                                          later=[passes[r.name] for r, _, _ in runs[i + 1:]], params=params)
        records.append(record)
    return records


def _run(name: str, surgery_pass: Any, method: str, *args: Any) -> Any:
    """`surgery_pass.method(*args)`; what else than a HibanaError or running out of memory it
    raises (a plugin's bug, a layout it did not expect) becomes a HibanaError that names the pass
    and its plugin."""
    import torch

    try:
        return getattr(surgery_pass, method)(*args)
    except (HibanaError, MemoryError, torch.OutOfMemoryError):
        raise
    except Exception as exc:
        raise HibanaError(f"surgery pass {name!r} ({describe_registered(surgery_pass)}) failed in {method}: "
                          f"{exc!r}; leave it out of surgery, or report it to its author") from exc


def configuration(base: str, dtype: "torch.dtype", kv_dtype: "torch.dtype", records: Sequence[dict]) -> dict:
    """What a state file's KV depends on: the checkpoint (and tokenizer), the compute and KV dtypes
    and the passes applied, with what they derived from data (a state saved under one of these
    does not load under another; a state file keeps this to say which one differs)."""
    passes = [{"name": r["name"], "params": r["params"], **({"digest": r["digest"]} if "digest" in r else {})}
              for r in records]
    return {"checkpoint": base, "dtype": str(dtype), "kv_dtype": str(kv_dtype), "surgery": passes}


def fingerprint(base: str, dtype: "torch.dtype", kv_dtype: "torch.dtype", records: Sequence[dict]) -> str:
    """`configuration`'s digest: equal for engines whose KV a state file may move between."""
    described = json.dumps(configuration(base, dtype, kv_dtype, records), sort_keys=True)
    return hashlib.sha256(described.encode()).hexdigest()
