"""Held-out evaluation of the demo model: `python -m hibana_core.demo.evaluate`.

200 seeded tasks whose tool names and argument names never occur in training (names.py), each
solved in a real tool loop: the model's calls run the Python tools, their results go back, until
the model answers (at most 4 assistant turns). Two measures:

    tool_call_ok   the first assistant turn is a parseable tool call with the right tool(s) and
                   the right arguments (an optional argument given its default value counts as
                   left out: the call is the same)
    answer_ok      the final answer contains every key value of the tool results (for a question
                   that needs no tool: the model answered without calling any)

The default task set is the one runs 1 and 2 were measured on. `--extended` draws the same seeds
with the corpus' side stream (run 3): 15% of the tasks become call-syntax, generic-tool, styled-text
or customer tasks, some values are non-ASCII and some schemas take LangChain's shapes.
`--set v2` poses the independent held-out set of heldout_v2.py instead (issue 15: other domains,
other phrasing, written before v2 was trained); parallel calls may come in any order there.

`--set perturbed` runs perturb.py's gauge: corpus v2 first calls with unseen values, tool names or
argument names (`--tasks` of them, each posed four ways). `--set reading` runs reading.py's gauge:
corpus v4 first calls among siblings, of training words and of words no training conversation has.

`--grammar off` evaluates without the tool-call grammar: the chat layer generates with
`parse_tools=False` (no grammar, the tools still in the prompt) and the hermes parser reads the
text afterwards, as `TransformersBackend` does. `on` (the default) is what users get.

Backends: `HibanaBackend` runs Hibana's Engine through the chat layer (what users get);
`TransformersBackend` runs a transformers model directly (used by train.py on the GPU).
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Protocol, Sequence

from hibana_core.demo import corpus, template
from hibana_core.demo.tasks import Task
from hibana_core.demo.tools import Tool

HELD_OUT_SEED = "heldout"
MAX_ROUNDS = 4
MAX_NEW_TOKENS = 160


@dataclass(frozen=True)
class Reply:
    text: str
    calls: list[tuple[str, dict]]   # (name, arguments) of well-formed tool calls
    malformed: bool = False


class Backend(Protocol):
    def respond(self, batch: Sequence[tuple[str, list[dict], list[dict] | None]]) -> list[Reply]:
        """One assistant turn for each (state key, messages, tools)."""


@dataclass
class Episode:
    index: int
    task: Task
    tools: list[Tool]
    messages: list[dict]
    replies: list[Reply] = field(default_factory=list)

    @property
    def final(self) -> str | None:
        last = self.replies[-1] if self.replies else None
        return last.text if last is not None and not last.calls else None


def _same(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b))
    return a == b


def same_call(call: tuple[str, dict], expected) -> bool:
    """Whether `call` is the expected call. An optional argument given its default value is the
    same call as one that leaves it out (a tool without `defaults` has none)."""
    name, args = call
    defaults = getattr(expected.tool, "defaults", {})
    got, want = defaults | args, defaults | expected.arguments
    return name == expected.tool.name and got.keys() == want.keys() and all(_same(got[k], want[k]) for k in got)


def calls_match(calls: list[tuple[str, dict]], expected) -> bool:
    return len(calls) == len(expected) and all(same_call(c, e) for c, e in zip(calls, expected))


def calls_match_any_order(calls: list[tuple[str, dict]], expected) -> bool:
    left = list(calls)
    for e in expected:
        hit = next((i for i, c in enumerate(left) if same_call(c, e)), None)
        if hit is None:
            return False
        del left[hit]
    return not left


def run_tool(tools: list[Tool], name: str, arguments: dict) -> str:
    tool = next((t for t in tools if t.name == name), None)
    return tool(arguments) if tool is not None else json.dumps({"error": f"unknown tool {name!r}"})


def run_episodes(backend: Backend, episodes: list[Episode], max_rounds: int = MAX_ROUNDS) -> list[Episode]:
    """Tool loops for all episodes at once, one assistant turn per round."""
    active = list(episodes)
    for _ in range(max_rounds):
        if not active:
            break
        replies = backend.respond([(f"eval-{e.index}", e.messages, [t.schema for t in e.tools]) for e in active])
        still = []
        for e, reply in zip(active, replies):
            e.replies.append(reply)
            if not reply.calls:
                continue
            e.messages = e.messages + [{"role": "assistant", "content": reply.text, "tool_calls": [
                {"type": "function", "function": {"name": n, "arguments": a}} for n, a in reply.calls]}]
            e.messages += [{"role": "tool", "name": n, "content": run_tool(e.tools, n, a)} for n, a in reply.calls]
            still.append(e)
        active = still
    return episodes


@dataclass
class EvalResult:
    n: int
    tool_call_ok: int
    answer_ok: int
    by_kind: dict[str, list[int]]       # kind -> [tasks, tool_call_ok, answer_ok]
    failures: list[dict]
    tool_name_ok: int = 0               # first turn names the right tool(s), arguments aside

    @property
    def tool_call_rate(self) -> float:
        return self.tool_call_ok / max(1, self.n)

    @property
    def answer_rate(self) -> float:
        return self.answer_ok / max(1, self.n)

    def summary(self) -> str:
        lines = [f"held-out tasks: {self.n}; first turn is the right tool call: {self.tool_call_rate:.1%}; "
                 f"final answer contains the result: {self.answer_rate:.1%}; "
                 f"right tool(s), arguments aside: {self.tool_name_ok / max(1, self.n):.1%}"]
        lines += [f"  {kind:<20} {n:>4}  calls {c / n:6.1%}  answers {a / n:6.1%}"
                  for kind, (n, c, a) in sorted(self.by_kind.items())]
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return asdict(self) | {"tool_call_rate": self.tool_call_rate, "answer_rate": self.answer_rate}


def held_out_episodes(n: int, seed: str = HELD_OUT_SEED, start: int = 0, extended: bool = False) -> list[Episode]:
    episodes = []
    for i in range(start, start + n):
        c = corpus.single_task(seed, i, held_out=True, extended=extended)
        episodes.append(Episode(i, c.tasks[0], c.tool_objects, c.messages))
    return episodes


def heldout_v2_episodes() -> list[Episode]:
    from hibana_core.demo import heldout_v2

    return [Episode(t.index, t, list(t.tools), list(t.messages)) for t in heldout_v2.tasks()]


def score(episodes: list[Episode], any_order: bool = False) -> EvalResult:
    result = EvalResult(len(episodes), 0, 0, {}, [])
    match = calls_match_any_order if any_order else calls_match
    for e in episodes:
        first = e.replies[0]
        expected = e.task.turns[0] if e.task.turns else ()
        call_ok = match(first.calls, expected)
        final = e.final
        answer_ok = final is not None and all(k in final for k in e.task.answer_keys)
        if e.task.turns and not e.task.turns[0]:       # a question that needs no tool: none may be called
            answer_ok = answer_ok and not any(r.calls for r in e.replies)
        result.tool_call_ok += call_ok
        result.tool_name_ok += sorted(n for n, _ in first.calls) == sorted(c.tool.name for c in expected)
        result.answer_ok += answer_ok
        row = result.by_kind.setdefault(e.task.kind, [0, 0, 0])
        row[0], row[1], row[2] = row[0] + 1, row[1] + call_ok, row[2] + answer_ok
        if not (call_ok and answer_ok) and len(result.failures) < 20:
            result.failures.append({"question": e.task.question, "expected": [
                (c.tool.name, c.arguments) for c in e.task.turns[0]], "replies": [asdict(r) for r in e.replies]})
    return result


def evaluate(backend: Backend, n: int = 200, seed: str = HELD_OUT_SEED, start: int = 0,
             extended: bool = False) -> EvalResult:
    return score(run_episodes(backend, held_out_episodes(n, seed, start, extended)))


def evaluate_v2(backend: Backend) -> EvalResult:
    """The independent held-out set (heldout_v2.py), every task."""
    return score(run_episodes(backend, heldout_v2_episodes()), any_order=True)


# --- backends -----------------------------------------------------------------------------------

class HibanaBackend:
    """Hibana's Engine through the chat layer; one state per episode, `concurrency` at a time.
    `grammar=False`: no tool-call grammar (`parse_tools=False`), the text parsed afterwards."""

    def __init__(self, engine, concurrency: int = 16, grammar: bool = True) -> None:
        from hibana_core.config import SamplingParams
        from hibana_plugins.manager import get_plugin_manager

        self.engine, self.concurrency, self.grammar = engine, concurrency, grammar
        self.params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0)
        self.parser = get_plugin_manager().lookup("tool_parser", "hermes")

    def _one(self, item) -> Reply:
        from hibana_core.chat import MALFORMED, Chat

        key, messages, tools = item
        chat = Chat(self.engine, key)
        if self.grammar:
            result = chat.respond(messages, tools, self.params)
            return Reply(result.text, [(c.name, c.arguments) for c in result.tool_calls],
                         result.finish_reason == MALFORMED)
        text = chat.respond(messages, tools, self.params, parse_tools=False).text
        parsed = self.parser.parse(text)
        return Reply(text if parsed.error else parsed.content,
                     [] if parsed.error else [(c.name, c.arguments) for c in parsed.tool_calls], parsed.error is not None)

    def respond(self, batch) -> list[Reply]:
        with ThreadPoolExecutor(self.concurrency) as pool:
            return list(pool.map(self._one, batch))


class TransformersBackend:
    """A transformers causal LM and a `tokenizers` tokenizer; greedy, batched, without a KV cache
    (short outputs, and right padding then needs no attention mask)."""

    def __init__(self, model, tok, batch_size: int = 64) -> None:
        from hibana_plugins.manager import get_plugin_manager

        self.model, self.tok, self.batch_size = model, tok, batch_size
        self.parser = get_plugin_manager().lookup("tool_parser", "hermes")
        self.stop_id = tok.token_to_id(template.END_OF_TURN)
        self.pad_id = tok.token_to_id("<|endoftext|>")

    def respond(self, batch) -> list[Reply]:
        prompts = [self.tok.encode(template.render(m, t, add_generation_prompt=True)).ids for _, m, t in batch]
        outputs = []
        for s in range(0, len(prompts), self.batch_size):
            outputs += self._greedy(prompts[s:s + self.batch_size])
        replies = []
        for ids in outputs:
            text = self.tok.decode(ids, skip_special_tokens=False)
            parsed = self.parser.parse(text)
            replies.append(Reply(text if parsed.error else parsed.content,
                                 [] if parsed.error else [(c.name, c.arguments) for c in parsed.tool_calls],
                                 parsed.error is not None))
        return replies

    def _greedy(self, prompts: list[list[int]]) -> list[list[int]]:
        import torch

        model = self.model
        device = next(model.parameters()).device
        rows = torch.arange(len(prompts), device=device)
        ids = torch.full((len(prompts), max(map(len, prompts)) + MAX_NEW_TOKENS), self.pad_id, device=device)
        for r, p in enumerate(prompts):
            ids[r, :len(p)] = torch.tensor(p, device=device)
        lens = torch.tensor([len(p) for p in prompts], device=device)
        done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
        out: list[list[int]] = [[] for _ in prompts]
        was_training = model.training
        model.eval()
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            for _ in range(MAX_NEW_TOKENS):
                hidden = model.model(input_ids=ids[:, :int(lens.max())], use_cache=False).last_hidden_state
                nxt = model.lm_head(hidden[rows, lens - 1]).float().argmax(-1)     # [batch]
                live = ~done
                ids[rows[live], lens[live]] = nxt[live]
                for r, (token, alive) in enumerate(zip(nxt.tolist(), live.tolist())):
                    if alive and token != self.stop_id:
                        out[r].append(token)
                lens = lens + live.long()
                done = done | (nxt == self.stop_id)
                if bool(done.all()):
                    break
        model.train(was_training)
        return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hibana_core.demo.evaluate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="demo", help="checkpoint directory (default: the bundled demo model)")
    p.add_argument("--tasks", type=int, default=200)
    p.add_argument("--seed", default=HELD_OUT_SEED)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--device", default="cpu")
    p.add_argument("--extended", action="store_true",
                   help="run 3's task set: call syntax, generic tools, non-ASCII values, LangChain-shaped schemas")
    p.add_argument("--set", choices=("v1", "v2", "perturbed", "reading"), default="v1",
                   help="v2: the independent held-out set of heldout_v2.py (--tasks, --seed, --extended unused); "
                        "perturbed: perturb.py's gauge, --tasks corpus v2 first calls posed four ways; "
                        "reading: reading.py's gauge, --tasks corpus v4 first calls of each kind")
    p.add_argument("--grammar", choices=("on", "off", "both"), default="on",
                   help="the tool-call grammar (off: parse_tools=False, the text parsed afterwards)")
    p.add_argument("--json", action="store_true", help="print the full result as JSON")
    args = p.parse_args(argv)
    from hibana_core import Engine

    modes = {"on": (True,), "off": (False,), "both": (True, False)}[args.grammar]
    with Engine.from_pretrained(args.model, device=args.device, progress=False) as engine:
        for grammar in modes:
            backend = HibanaBackend(engine, args.concurrency, grammar=grammar)
            print(f"grammar {'on' if grammar else 'off'}:", flush=True)
            if args.set in ("perturbed", "reading"):
                from hibana_core.demo import perturb, reading

                result = (perturb if args.set == "perturbed" else reading).evaluate(backend, args.tasks)
                print(json.dumps(result, indent=1) if args.json else perturb.summary(result), flush=True)
                continue
            result = evaluate_v2(backend) if args.set == "v2" else evaluate(backend, args.tasks, args.seed,
                                                                            extended=args.extended)
            print(json.dumps(result.as_dict(), indent=1) if args.json else result.summary(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
