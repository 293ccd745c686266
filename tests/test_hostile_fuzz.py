"""Every public entry point of the engine under hostile input (issue 12): each call either works or
raises a `HibanaError` subclass; a failed call leaves its state as it was; a bystander agent that
generates meanwhile gets exactly the tokens it gets alone.

Seeded and bounded for CI; `HIBANA_FUZZ_ENGINE=N` draws N random cases per class instead of the
default (a nightly-style run).
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import threading
import time

import pytest

from hibana_core import Engine, HibanaError, SamplingParams
from hibana_core.config import CacheConfig, EngineConfig, SchedulerConfig
from tiny_models import random_tokens

ARCH = "llama"
CASES = int(os.environ.get("HIBANA_FUZZ_ENGINE", "60"))

pytestmark = pytest.mark.timeout(600)

# values of every kind a caller might pass by mistake (or on purpose)
HOSTILE = [None, "", "3", "auto", 1.5, -1, 0, 1, 3, True, False, 10**13, -(10**13), math.nan, math.inf,
           [], {}, (), [1.5], ["5"], [True], [-1], [10**9], [None], "\ud800", b"x", object(), 2**64]


def hostile(rng: random.Random):
    return rng.choice(HOSTILE)


def check(call, *, failures: list, label: str) -> bool:
    """Run `call`; True if it worked, False if it raised a HibanaError; any other exception is a
    failure of the rule, recorded with its label."""
    try:
        call()
        return True
    except HibanaError:
        return False
    except Exception as exc:  # noqa: BLE001 - the rule is that nothing else escapes
        failures.append(f"{label}: {type(exc).__name__}: {exc}"[:300])
        return False


class Bystander:
    """An agent that generates greedily, turn after turn on a thread, for as long as the hostile
    calls run (so they share its steps); every turn must give its output alone."""

    def __init__(self, engine: Engine, seed: int) -> None:
        self.prompt = random_tokens(random.Random(seed), 40)
        self.params = SamplingParams(max_tokens=24, ignore_eos=True)
        solo = engine.open_state(f"bystander-solo-{seed}")
        self.want = solo.generate(self.params, prompt=self.prompt).token_ids
        solo.close()
        self.handle = engine.open_state(f"bystander-{seed}")
        self.turns: list[list[int]] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        while not self.turns and self.thread.is_alive():  # generating before the first hostile call
            time.sleep(0.01)

    def _run(self) -> None:
        while not self.done.is_set():
            self.turns.append(self.handle.generate(self.params, prompt=self.prompt).token_ids)

    def finish(self) -> None:
        self.done.set()
        self.thread.join(timeout=60)
        assert not self.thread.is_alive(), "the bystander is stuck"
        assert len(self.turns) >= 2 and all(t == self.want for t in self.turns), \
            "a hostile call changed another agent's output"


@pytest.fixture
def engine(tiny_checkpoints, make_engine):
    return make_engine(tiny_checkpoints[ARCH], num_blocks=64, max_model_len=256)


def test_engine_options(tiny_checkpoints, tmp_path, monkeypatch):
    """Every engine option with every hostile value: a HibanaError or an engine. (Speculation off
    but where it is the option: its start-up profile is most of a tiny engine's 0.2 s, and the
    options' checks do not depend on it. In a scratch folder: "3" and "auto" are folder names.)"""
    monkeypatch.chdir(tmp_path)
    path = tiny_checkpoints[ARCH]
    failures: list[str] = []
    names = [f.name for kind in (EngineConfig, CacheConfig, SchedulerConfig) for f in dataclasses.fields(kind)
             if f.name not in ("model", "cache", "scheduler")]
    rng = random.Random(0)
    cases = [(name, value) for name in names for value in HOSTILE]
    if CASES > 60:
        cases += [(rng.choice(names), hostile(rng)) for _ in range(CASES)]
    for name, value in cases:
        engine = None

        def build():
            nonlocal engine
            engine = Engine.from_pretrained(path, **{"progress": False, "speculation": "off", name: value})

        check(build, failures=failures, label=f"Engine.from_pretrained({name}={value!r})")
        if engine is not None:
            engine.close()
    check(lambda: Engine.from_pretrained(path, progress=False, no_such_option=1), failures=failures,
          label="unknown option")
    assert not failures, "\n".join(failures)


def test_sampling_params_on_a_running_engine(engine):
    """Every SamplingParams field with every hostile value: refused at construction, or run (capped
    at a few tokens) beside a bystander that must not notice."""
    failures: list[str] = []
    bystander = Bystander(engine, 1)
    h = engine.open_state("hostile")
    base = random_tokens(random.Random(2), 20)
    h.sync(base)
    rng = random.Random(3)
    names = [f.name for f in dataclasses.fields(SamplingParams)]
    cases = [(name, value) for name in names for value in HOSTILE]
    cases += [(rng.choice(names), hostile(rng)) for _ in range(CASES)]
    for name, value in cases:
        params = None

        def build():
            nonlocal params
            params = SamplingParams(**{name: value})

        if not check(build, failures=failures, label=f"SamplingParams({name}={value!r})"):
            continue
        params = dataclasses.replace(params, max_tokens=min(params.max_tokens, 3))
        check(lambda: h.generate(params), failures=failures, label=f"generate({name}={value!r})")
        check(lambda: h.sync(base), failures=failures, label="sync back")
    check(lambda: h.generate("greedy"), failures=failures, label="generate(params='greedy')")
    bystander.finish()
    assert not failures, "\n".join(failures)


def test_state_operations(engine, tmp_path, monkeypatch):
    """Each operation of a handle and of the engine with hostile arguments: a HibanaError leaves
    the state exactly as it was."""
    monkeypatch.chdir(tmp_path)  # hostile "paths" such as 3 or "auto" are relative: keep them out of the checkout
    failures: list[str] = []
    bystander = Bystander(engine, 4)
    h = engine.open_state("hostile")
    base = random_tokens(random.Random(5), 30)
    h.sync(base)
    good_file = tmp_path / "good.safetensors"
    h.save(good_file)

    def token_list(r: random.Random):
        kind = r.randrange(6)
        if kind == 0:
            return hostile(r)
        if kind == 1:
            return [hostile(r) for _ in range(r.randrange(1, 4))]
        if kind == 2:
            return random_tokens(r, r.randrange(0, 400))  # past the context of 256 too
        if kind == 3:
            return base[:r.randrange(0, 30)] + [r.choice([-1, 10**6, 511, 0])]
        if kind == 4:
            return iter(base)
        return random_tokens(r, 5)

    def lease_once(tokens, state_id):
        with engine.lease(tokens, state_id=state_id) as leased:
            leased.sync(tokens)

    operations = {
        "sync": lambda r: h.sync(token_list(r)),
        "append": lambda r: h.append(token_list(r)),
        "generate(prompt)": lambda r: h.generate(SamplingParams(max_tokens=2), prompt=token_list(r)),
        "stream(prompt)": lambda r: list(h.stream(SamplingParams(max_tokens=2), prompt=token_list(r))),
        "truncate": lambda r: h.truncate(hostile(r)),
        "fork": lambda r: h.fork(hostile(r)),
        "save": lambda r: h.save(r.choice([hostile(r), tmp_path, tmp_path / "\ud800", "/proc/no/such/dir/x"])),
        "open_state": lambda r: engine.open_state(hostile(r)),
        "load_state": lambda r: engine.load_state(r.choice([hostile(r), tmp_path, good_file]), state_id=hostile(r)),
        "match_state": lambda r: engine.match_state(token_list(r), min_shared=hostile(r)),
        "lease": lambda r: lease_once(token_list(r), hostile(r)),
    }
    cases = [(name, seed) for name in operations for seed in range(max(8, CASES // 4))]
    for name, seed in cases:
        before = h.tokens
        ok = check(lambda: operations[name](random.Random(seed)), failures=failures, label=f"{name} #{seed}")
        if not ok:
            assert h.tokens == before, f"{name} #{seed} failed and changed the state"
        check(lambda: h.sync(base), failures=failures, label="sync back")
        for info in engine.states():  # states that a case made (forks, loads, leases): close them
            if info.id not in ("hostile", bystander.handle.id) and not info.busy:
                engine.open_state(info.id).close()
    bystander.finish()
    assert not failures, "\n".join(failures)
