"""An engine's start as a user sees it: one progress bar over every stage (stderr, off with
progress=False), the stages timed in `engine.load_times`, and logs under the `hibana` logger that
stay silent until the user configures logging."""

from __future__ import annotations

import logging
import random
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hibana_core import SamplingParams
from tiny_models import open_engine, random_tokens

ROOT = Path(__file__).resolve().parents[1]
ARCH = "qwen3"
STAGES = ["resolve", "config", "weights", "tokenizer", "kv cache", "warm-up"]


def test_every_stage_is_timed_and_shown_on_stderr(tiny_checkpoints, capsys):
    path = tiny_checkpoints[ARCH]
    with open_engine(path, progress=True) as engine:
        assert list(engine.load_times) == STAGES
        assert all(seconds >= 0 for seconds in engine.load_times.values())
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"hibana: loading {path}" in captured.err
    for stage in STAGES:
        assert stage in captured.err, stage
    assert "hibana: weights" in captured.err  # the weight tensors, nested
    assert "\x1b[" not in captured.err  # stderr is not a terminal: no cursor movement in a log


def test_surgery_bars_in_a_log_have_no_terminal_codes(tiny_checkpoints, tmp_path):
    """`hibana surgery` with stderr sent to a file: the loading, weights, guard and pass bars are all
    there as text, without the cursor-up codes tqdm nests bars with in a terminal."""
    log = tmp_path / "surgery.log"
    with log.open("w") as stderr:
        result = subprocess.run([sys.executable, "-m", "hibana_core.cli", "surgery", str(tiny_checkpoints[ARCH]),
                                 "--passes", "w8", "--out", str(tmp_path / "w8")],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True, timeout=600)
    text = log.read_text()
    assert result.returncode == 0, text
    for bar in ("hibana: loading", "hibana: weights", "guard: unmodified model", "surgery w8"):
        assert bar in text, bar
    assert "\x1b[" not in text, repr(text)


def test_surgery_is_a_stage_and_in_memory_models_time_theirs(tiny_checkpoints, capsys):
    with open_engine(tiny_checkpoints[ARCH], surgery=["w8"], surgery_guard=False) as engine:
        assert list(engine.load_times) == STAGES[:4] + ["surgery"] + STAGES[4:]
    from hibana_core import Engine
    from tiny_models import _hf_model

    with Engine.from_hf_model(_hf_model(str(tiny_checkpoints[ARCH])), device="cpu", progress=False,
                              num_blocks=64) as engine:
        assert list(engine.load_times) == ["weights", "kv cache", "warm-up"]


def test_progress_false_writes_nothing(tiny_checkpoints, capsys):
    with open_engine(tiny_checkpoints[ARCH], progress=False) as engine:
        engine.open_state("a").generate(SamplingParams(max_tokens=2), prompt=[5, 6, 7])
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_tqdm_disable_hides_every_bar(tiny_checkpoints, capsys, monkeypatch):
    """TQDM_DISABLE=1, tqdm's own switch, hides Hibana's bars too, though they pass `disable`
    (tqdm reads its environment only for the arguments not given)."""
    monkeypatch.setenv("TQDM_DISABLE", "1")
    with open_engine(tiny_checkpoints[ARCH], progress=True) as engine:
        engine.open_state("a").generate(SamplingParams(max_tokens=2), prompt=[5, 6, 7])
    assert capsys.readouterr().err == ""


def test_logs_are_silent_unless_configured(tiny_checkpoints):
    """A fresh interpreter that configures no logging: nothing on stdout or stderr, though every
    logger fires (load, lease, request, eviction)."""
    script = f"""
        import sys
        sys.path.insert(0, {str(ROOT / 'tests')!r})
        from tiny_models import open_engine
        from hibana_core import SamplingParams
        with open_engine({str(tiny_checkpoints[ARCH])!r}, num_blocks=8, speculation="off") as engine:
            with engine.lease(list(range(5, 60))) as h:
                h.generate(SamplingParams(max_tokens=2), prompt=list(range(5, 60)))
            engine.open_state("b").sync(list(range(100, 180)))   # evicts the first state's KV
        import logging
        assert any(isinstance(h, logging.NullHandler) for h in logging.getLogger("hibana").handlers)
    """
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "" and result.stderr == "", result.stderr


def test_loading_builds_the_model_without_random_init(tiny_checkpoints):
    """The model is built on the meta device with torch.nn.init's functions as no-ops (`to_empty`
    discards the values): a meta tensor's random init imported torch._dynamo, 1.8 s of `hibana
    demo`'s 7.8 s cold start on a 2-core CPU. The functions are torch's own again afterwards."""
    script = f"""
        import sys
        import torch
        sys.path.insert(0, {str(ROOT / 'tests')!r})
        from tiny_models import open_engine
        from hibana_core import SamplingParams
        before = dict(vars(torch.nn.init))
        with open_engine({str(tiny_checkpoints[ARCH])!r}, num_blocks=8, speculation="off") as engine:
            engine.open_state("a").generate(SamplingParams(max_tokens=2), prompt=list(range(5, 30)))
        assert "torch._dynamo" not in sys.modules, "random init of the meta model imported torch._dynamo"
        assert dict(vars(torch.nn.init)) == before, "torch.nn.init left patched"
    """
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr


def test_logs_say_what_served_each_call(tiny_checkpoints, caplog):
    caplog.set_level(logging.DEBUG, logger="hibana")
    with open_engine(tiny_checkpoints[ARCH], num_blocks=8, speculation="off") as engine:
        messages = [r.getMessage() for r in caplog.records]
        assert any(m.startswith(f"loaded {tiny_checkpoints[ARCH]} on cpu in ") and "weights" in m for m in messages)
        assert any("warm-up took" in m for m in messages)                      # DEBUG: each stage
        caplog.clear()
        prompt = random_tokens(random.Random(1), 40)
        with engine.lease(prompt) as h:
            h.generate(SamplingParams(max_tokens=3), prompt=prompt)
            history = h.tokens
        with engine.lease(history + [7]) as again:
            assert again.id == h.id
        by_logger = {}
        for r in caplog.records:
            by_logger.setdefault(r.name, []).append(r.getMessage())
        assert f"state {h.id} serves a call of 40 tokens (new" in by_logger["hibana.states"][0]
        assert "continues its conversation (43 tokens held)" in by_logger["hibana.states"][1]
        assert by_logger["hibana.requests"] == [
            f"state {h.id}: generate length, prompt 40 tokens (0 reused, 40 computed), 3 generated in "
            + by_logger["hibana.requests"][0].rsplit(" in ", 1)[1]]
        caplog.clear()
        engine.open_state("b").sync(random_tokens(random.Random(2), 100))  # needs the pool
        assert any("evicting an idle state's KV" in r.getMessage() for r in caplog.records)


def test_a_new_state_the_chat_layer_leases_is_logged_without_a_made_up_count(caplog):
    """`hibana serve` logged "state auto-... serves a call of 0 tokens (new: ...)" for every new
    conversation: the chat layer leases a new state without the call's tokens."""
    from hibana_core import Engine
    from hibana_core.chat import Chat

    with Engine.from_pretrained("demo", progress=False, speculation="off") as engine:
        caplog.set_level(logging.INFO, logger="hibana.states")
        with Chat(engine).lease("<|im_start|>user\nHello!<|im_end|>\n") as chat:
            pass
    messages = [r.getMessage() for r in caplog.records if r.name == "hibana.states"]
    assert messages[0] == f"state {chat.handle.id} serves a call (new: no idle state holds the start of this " \
                          "conversation)", messages


def test_a_conversation_the_chat_layer_continues_is_logged_as_such(caplog):
    """An adapter call that named no state and continues an earlier call's conversation was logged
    "named by the call": the chat layer leases the state it matched by its id."""
    from hibana_core import Engine, turn
    from hibana_core.chat import Chat

    with Engine.from_pretrained("demo", progress=False, speculation="off") as engine:
        chat = Chat(engine)
        messages = [{"role": "user", "content": "What is 12 times 7?"}]
        params = SamplingParams(max_tokens=8)
        *_, first = turn.run(chat.opener(chat.render_text(messages), params=params, lease=True), turn.result_of)
        messages += [{"role": "assistant", "content": first.content}, {"role": "user", "content": "Thanks!"}]
        (held,) = engine.states()
        caplog.set_level(logging.INFO, logger="hibana.states")
        *_, second = turn.run(chat.opener(chat.render_text(messages), params=params, lease=True), turn.result_of)
    assert second.usage.cached_tokens > 0
    messages = [r.getMessage() for r in caplog.records if r.name == "hibana.states"]
    assert messages == [f"state {held.id} serves a call (continues its conversation, {held.tokens} tokens held)"]


def test_a_call_whose_state_is_busy_is_logged_as_such(caplog):
    """A LangGraph Send fan-out (one node's calls at once on one thread) names one state; the calls
    that find it busy go to another, which was logged only as "new: no idle state holds the start
    of this conversation", as though the thread's id had not been read."""
    from hibana_core import Engine
    from hibana_core.chat import Chat

    prompt = "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n"
    with Engine.from_pretrained("demo", progress=False, speculation="off") as engine:
        chat = Chat(engine)
        with chat.lease(prompt, "t1/worker", fallback=True):
            caplog.set_level(logging.INFO, logger="hibana.states")
            with chat.lease(prompt, "t1/worker", fallback=True) as other:
                pass
    messages = [r.getMessage() for r in caplog.records if r.name == "hibana.states"]
    assert messages[0] == "state t1/worker is serving another call; this call goes to another state", messages
    assert messages[1].startswith(f"state {other.handle.id} serves a call (new"), messages


def test_cold_start_probe_leaves_no_state(tiny_checkpoints):
    from hibana_core.coldstart import ColdStart, first_token_seconds, process_start_time

    with open_engine(tiny_checkpoints[ARCH], speculation="off") as engine:
        assert first_token_seconds(engine) > 0
        assert engine.states() == []
    started = process_start_time()
    assert started is None or 0 < time.time() - started < 86400
    cold = ColdStart(1.0, 2.0, 0.5, {"weights": 1.5})
    assert cold.total_s == 3.5 and cold.as_dict()["total_s"] == 3.5
    assert cold.describe().startswith("cold start 3.50 s to the first token: startup 1.00 s")
