"""The bundled demo agent model: a complete checkpoint that really calls tools it has never seen.

The held-out floors are below what was measured on the same 100 tasks with the committed weights
(99% and 99%, see bench/notes_demo_training.md), leaving room for float differences between CPUs;
the issue's targets are 90% and 80%.
"""

from __future__ import annotations

import json
import struct

import pytest

from hibana_core import Engine
from hibana_core.demo import corpus, evaluate, names, template, tools
from hibana_core.demo.tools import FAMILIES, make_tool
from hibana_core.loader import DEMO_MODEL_DIR

HELD_OUT_TASKS = 100
TOOL_CALL_FLOOR = 0.95
ANSWER_FLOOR = 0.95


def test_checkpoint_is_a_small_qwen3():
    config = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["tie_word_embeddings"]
    weights = DEMO_MODEL_DIR / "model.safetensors"
    assert weights.stat().st_size <= 16_000_000
    with weights.open("rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
    tok_config = json.loads((DEMO_MODEL_DIR / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"] == template.CHAT_TEMPLATE
    generation = json.loads((DEMO_MODEL_DIR / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [config["eos_token_id"]]


def test_tokenizer_special_tokens():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(DEMO_MODEL_DIR / "tokenizer.json"))
    assert tok.get_vocab_size() == 4096
    assert [tok.token_to_id(t) for t in template.SPECIAL_TOKENS] == [0, 1, 2]
    for t in template.SPECIAL_TOKENS + template.TOOL_TOKENS:
        assert tok.encode(f"a{t}b").tokens[1] == t, f"{t} is not a single token"


def test_held_out_names_never_appear_in_training():
    for i in range(300):
        c = corpus.conversation(0, i)
        for tool in c.tool_objects:
            assert not names.is_held_out(tool.name)
            assert not any(names.is_held_out(a) for a in tool.arg_names)
    for e in evaluate.held_out_episodes(50) + evaluate.held_out_episodes(50, extended=True):
        assert all(names.is_held_out(t.name) and all(names.is_held_out(a) for a in t.arg_names) for t in e.tools)


def test_corpus_is_seeded():
    a, b = corpus.conversation(3, 17), corpus.conversation(3, 17)
    assert a.messages == b.messages and a.tools == b.tools
    assert corpus.conversation(4, 17).messages != a.messages


def test_run3_additions_come_from_the_side_stream():
    """Call-syntax, generic-tool and customer tasks and non-ASCII values come in a fair share of the
    corpus; everything else is drawn as in run 2, and a plain generator (`hibana demo`) gets none."""
    import random

    from hibana_core.demo import tasks as T, world

    kinds, non_ascii, n = {}, 0, 600
    for i in range(n):
        c = corpus.conversation(0, i)
        for task in c.tasks:
            kinds[task.kind] = kinds.get(task.kind, 0) + 1
        non_ascii += any(ord(ch) > 127 for m in c.messages for ch in (m.get("content") or ""))
    tasks = sum(kinds.values())
    extra = sum(kinds.get(k, 0) for k in T.EXTRA_MAKERS)
    assert 0.08 < extra / tasks < 0.25, kinds
    assert 0.04 < non_ascii / n < 0.18
    rng = random.Random(5)
    box = corpus.ToolBox(rng, held_out=False)
    plain = [T.make_task(rng, kind, box) for kind in corpus.pick_kinds(rng, 50)]
    box.add_distractors(3)
    assert not any(t.kind in T.EXTRA_MAKERS for t in plain)
    assert all(f in FAMILIES and f not in tools.EXTRA_FAMILIES for f in box.by_family)
    assert all(ord(ch) < 128 for t in plain for ch in t.question)
    side = world.with_extra("k")
    assert world.extra(side) is not None and world.extra(random.Random("k")) is None


def test_call_syntax_tasks_copy_the_values():
    from hibana_core.demo import tasks as T, world

    rng = world.with_extra("call")
    for _ in range(200):
        box = corpus.ToolBox(rng, held_out=False)
        task = T.make_task(rng, "call_syntax", box)
        (c,), = task.turns
        assert c.tool.name in task.question
        for value in c.arguments.values():
            assert (value if isinstance(value, str) else str(value)) in task.question
        assert all(k in task.answer for k in task.answer_keys)
        task = T.make_task(rng, "customer", box)
        name = task.turns[0][0].arguments[task.turns[0][0].tool.arg_names[0]]
        assert name in task.question and name in task.answer


def test_corpus_does_not_hold_the_langchain_tests():
    """No training on the test: langchain-tests' tool names, descriptions and strings never occur."""
    banned = ("magic_function", "Apply a magic function to an input.", "Calculate a magic function.",
              "unicode_customer", "greeting_generator", "你好啊集团", "こんにちは", "Hello Group", "Pirate",
              "What is the value of magic_function")
    for i in range(2000):
        c = corpus.conversation(0, i)
        text = template.render(c.messages, c.tools)
        assert not any(b in text for b in banned), i
        assert all(t.name.replace("_", "").lower() not in tools.EXCLUDED_NAMES for t in c.tool_objects)


def test_tools_are_python_functions():
    import random

    tool = make_tool(random.Random(0), "multiply", held_out=False, taken=set())
    a, b = tool.arg_names
    assert json.loads(tool({a: 6, b: 7})) == {"result": 42}
    assert "error" in json.loads(tool({a: 6}))
    assert "error" in json.loads(tool({a: "six", b: 7}))
    convert = make_tool(random.Random(0), "convert", held_out=False, taken=set())
    assert json.loads(convert(dict(zip(convert.arg_names, (10, "km", "miles"))))) == {"value": 6.21, "unit": "miles"}
    assert set(FAMILIES) >= {"add", "weather", "convert", "search", "read_file", "record_book"}


@pytest.fixture(scope="module")
def held_out_result():
    with Engine.from_pretrained("demo", device="cpu", progress=False) as engine:
        assert engine.tokenizer.convert_tokens_to_ids(template.END_OF_TURN) in engine.eos_token_ids
        return evaluate.evaluate(evaluate.HibanaBackend(engine, concurrency=16), HELD_OUT_TASKS)


def test_held_out_tool_calls(held_out_result):
    """Tool and argument names never seen in training: the first turn calls the right tool with
    the right arguments."""
    assert held_out_result.n == HELD_OUT_TASKS
    assert held_out_result.tool_call_rate >= TOOL_CALL_FLOOR, held_out_result.summary()


def test_held_out_final_answers(held_out_result):
    """After the tool loop, the final answer quotes the tool's result."""
    assert held_out_result.answer_rate >= ANSWER_FLOOR, held_out_result.summary()


def test_demo_agents_keep_their_state_between_turns():
    """`hibana demo`'s workload: 8 agents x 3 tasks. From the second turn on, every agent reuses
    at least 95% of what its state held (measured: 99.8%), and most tasks are solved (22/24)."""
    from hibana_core.demo.run import run_demo

    with Engine.from_pretrained("demo", device="cpu", progress=False) as engine:
        result = run_demo(engine, agents=8, n_tasks=3)
    assert not result.errors
    assert len(result.views) == 8 and all(len(v.solved) == 3 for v in result.views)
    assert result.solved >= 20
    later = [r for r in result.records if r.turn >= 2]
    assert later and all(r.reused >= 0.95 * r.history_tokens for r in later)
    first = [r for r in result.records if r.turn == 1]
    assert sum(r.reused for r in first) > 0, "agents share no prefix blocks (system prompt)"


def test_demo_command_exits_zero():
    """The installed console script, as a user runs it (the full 8 x 3 workload is tested above)."""
    import subprocess

    done = subprocess.run(["hibana", "demo", "--agents", "2", "--tasks", "1", "--device", "cpu",
                           "--no-live"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "tasks solved" in done.stdout and "reused" in done.stdout



def test_tools_answer_badly_typed_arguments_with_an_error_result():
    """The evaluator runs whatever a model calls: a value of the wrong JSON type is an error result the
    model reads (an int for search's query crashed train.py's evaluation of a v4 checkpoint), while
    every task's own calls still run clean: v1's held-out sets and heldout_v2."""
    import json

    from hibana_core.demo import heldout_v2

    wrong = {"string": 3, "integer": "3", "number": True, "boolean": "yes", "array": "a", "object": []}
    tasks = [e.task for e in evaluate.held_out_episodes(60) + evaluate.held_out_episodes(60, extended=True)]
    tools = {}
    for task in tasks + list(heldout_v2.tasks()):
        for call in (c for turn in task.turns for c in turn):
            assert call.tool(call.arguments) == call.result
            tools[call.tool.name] = (call.tool, call.arguments)
    checked = 0
    for tool, arguments in tools.values():
        properties = tool.schema["function"]["parameters"]["properties"]
        for n, value in arguments.items():
            bad = dict(arguments, **{n: wrong[properties[n]["type"]]})
            assert n in json.loads(evaluate.run_tool([tool], tool.name, bad))["error"]
            if properties[n]["type"] == "array" and value:
                listed = dict(arguments, **{n: [wrong[properties[n]["items"]["type"]]]})
                assert n in json.loads(evaluate.run_tool([tool], tool.name, listed))["error"]
            checked += 1
    assert checked > 100
