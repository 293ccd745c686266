"""`hibana demo` with more tasks than one conversation holds: the failed agent is named with its
task and told what to change, and the others run on (the README: the demo model's context is
2,048 tokens)."""

from __future__ import annotations

from hibana_core import ContextLengthError, Engine
from hibana_core.demo.run import run_demo


def test_an_agent_whose_conversation_outgrows_the_context_says_to_give_fewer_tasks():
    with Engine.from_pretrained("demo", device="cpu", progress=False, speculation="off", max_model_len=400,
                                kv_device_blocks=64) as engine:
        result = run_demo(engine, agents=1, n_tasks=3, max_tokens=32)
    [failure] = result.errors
    assert failure.agent == 0 and isinstance(failure.error, ContextLengthError)
    assert result.views[0].status == "failed: ContextLengthError"
    line = failure.describe(tasks=3)
    assert line.startswith(f"agent 0 failed at task {failure.task} of 3: ContextLengthError: ")
    assert line.endswith("give fewer --tasks")
