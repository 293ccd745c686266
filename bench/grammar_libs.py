"""xgrammar against llguidance on the host: grammar compile time and token-mask time per token.

    python -m hibana_bench.grammar_libs                    # demo tokenizer and a 151k vocabulary
    python -m hibana_bench.grammar_libs --json out.json

For each tokenizer (the demo model's 4,096 ids; a byte-level BPE of Qwen3's size, 151,643 ids plus
Qwen3's added tokens, trained here on the Python sources of this machine when none is given with
`--big-tokenizer`) and each grammar (a JSON schema with nested objects, arrays, enums, optional
keys; a hermes tool-call grammar over four tools, as the chat layer builds it for
tool_choice="auto" and "required"), the script walks a valid output token by token and times, per
token, the mask computation (`fill_next_token_bitmask` / `fill_next_token_bitmask`) and the
advance (`accept_token` / `consume_token`), single-threaded, as the engine calls them. Also: the
tokenizer set-up once per engine, and the first compile of each grammar (no cache).

    python -m hibana_bench.grammar_libs --walks 32         # the engine's masks under random walks

`--walks B`: B requests under the JSON schema of `hibana bench grammar`, each taking a random
allowed token a step (what a model with random weights does: long strings of any text), their
masks filled each step by the engine's `Grammars.masks` and by the ways to fill them in
parallel (xgrammar's batch matcher, Python threads), each variant on the same walk: where a
constrained batch's host time goes, and which threads shorten it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

import torch

DEMO = Path(__file__).resolve().parent.parent / "hibana_core" / "demo" / "model"
QWEN3_ADDED = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
               "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
               "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
               "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>",
               "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
NOT_SPECIAL = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "year": {"type": "integer"},
        "genre": {"type": "string", "enum": ["fiction", "history", "science", "poetry"]},
        "authors": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string"}, "born": {"type": "integer"}}, "required": ["name"]}},
        "tags": {"type": "array", "items": {"type": "string"}},
        "rating": {"anyOf": [{"type": "number"}, {"type": "null"}]},
        "in_print": {"type": "boolean"},
    },
    "required": ["title", "year", "genre", "authors"],
}
SCHEMA_TEXT = json.dumps({"title": "The Silent River: a history of the upper valley", "year": 1987,
                          "genre": "history", "authors": [{"name": "Maya Tanaka", "born": 1951},
                                                          {"name": "Olu Adeyemi"}],
                          "tags": ["rivers", "maps", "twentieth century"], "rating": 4.5, "in_print": True})

TOOLS = [
    {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}},
    {"name": "search_flights", "parameters": {"type": "object", "properties": {
        "origin": {"type": "string"}, "destination": {"type": "string"}, "date": {"type": "string"},
        "passengers": {"type": "integer"}, "cabin": {"type": "string", "enum": ["economy", "business"]}},
        "required": ["origin", "destination", "date"]}},
    {"name": "add_calendar_event", "parameters": {"type": "object", "properties": {
        "title": {"type": "string"}, "start": {"type": "string"}, "attendees": {"type": "array",
                                                                                 "items": {"type": "string"}},
        "reminder": {"type": "object", "properties": {"minutes": {"type": "integer"}}}},
        "required": ["title", "start"]}},
    {"name": "convert_currency", "parameters": {"type": "object", "properties": {
        "amount": {"type": "number"}, "from": {"type": "string"}, "to": {"type": "string"}},
        "required": ["amount", "from", "to"]}},
]
CALL_TEXT = ('<tool_call>\n{"name": "search_flights", "arguments": {"origin": "Lisbon", "destination": '
             '"Osaka", "date": "2026-03-14", "passengers": 2}}\n</tool_call>')
AUTO_TEXT = "Let me look that up for you. " + CALL_TEXT


def build_big_tokenizer(path: Path, corpus_bytes: int = 160_000_000) -> Path:
    """A byte-level BPE with Qwen3's vocabulary size and added tokens, trained on this machine's
    Python sources (code and docs), with the demo tokenizer's pre-tokenizer (Qwen2's regex)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    import site

    out = path / "tokenizer.json"
    if out.exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    files = sorted(str(p) for root in site.getsitepackages() for p in Path(root).rglob("*")
                   if p.suffix in (".py", ".md", ".txt", ".rst") and p.is_file())
    random.Random(0).shuffle(files)

    def texts():
        total = 0
        for name in files:
            try:
                text = open(name, encoding="utf-8", errors="ignore").read()
            except OSError:
                continue
            total += len(text)
            yield text
            if total > corpus_bytes:
                return
    demo = json.loads((DEMO / "tokenizer.json").read_text())
    split = demo["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=151_643, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts(), trainer)
    from tokenizers import AddedToken
    tok.add_tokens([AddedToken(t, special=t not in NOT_SPECIAL, normalized=False) for t in QWEN3_ADDED])
    tok.save(str(out))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))
    return path


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def _stats(samples: list[float]) -> dict:
    s = sorted(samples)
    return {"mean_us": round(1e6 * statistics.fmean(s), 1), "p50_us": round(1e6 * s[len(s) // 2], 1),
            "p99_us": round(1e6 * s[min(len(s) - 1, int(0.99 * len(s)))], 1), "max_us": round(1e6 * s[-1], 1),
            "tokens": len(s)}


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        start = time.perf_counter()
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=[tokenizer.convert_tokens_to_ids("<|im_end|>")])
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.setup_s = time.perf_counter() - start
        self.vocab_size = vocab_size

    def compile(self, kind: str, spec) -> object:
        if kind == "json":
            return self.compiler.compile_json_schema(json.dumps(spec))
        return self.compiler.compile_structural_tag(json.dumps(spec))

    def batch(self, compiled, tokens: list[int], size: int) -> list[float]:
        """Masks of `size` matchers at staggered positions of the walk, in one call per step."""
        matchers = [self.xgr.GrammarMatcher(compiled) for _ in range(size)]
        bitmask = self.xgr.allocate_token_bitmask(size, self.vocab_size)
        batch = self.xgr.BatchGrammarMatcher(max_threads="auto")
        for i, m in enumerate(matchers):
            for t in tokens[:i % len(tokens)]:
                m.accept_token(t)
        times = []
        for step in range(len(tokens) // 2):
            t0 = time.perf_counter()
            batch.batch_fill_next_token_bitmask(matchers, bitmask)
            times.append(time.perf_counter() - t0)
            for i, m in enumerate(matchers):
                m.accept_token(tokens[(i + step) % len(tokens)]) or m.reset()
        return times

    def walk(self, compiled, tokens: list[int]) -> tuple[list[float], list[float]]:
        matcher = self.xgr.GrammarMatcher(compiled)
        bitmask = self.xgr.allocate_token_bitmask(1, self.vocab_size)
        masks, accepts = [], []
        for token in tokens:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask, 0)
            t1 = time.perf_counter()
            ok = matcher.accept_token(token)
            t2 = time.perf_counter()
            assert ok, f"xgrammar rejected token {token}"
            masks.append(t1 - t0)
            accepts.append(t2 - t1)
        return masks, accepts


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.ll = llguidance
        start = time.perf_counter()
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                eos_token=tokenizer.convert_tokens_to_ids("<|im_end|>"))
        self.setup_s = time.perf_counter() - start
        self.vocab_size = vocab_size

    def compile(self, kind: str, spec) -> object:
        if kind == "json":
            grammar = self.ll.LLMatcher.grammar_from_json_schema(spec)
        else:
            grammar = spec
        matcher = self.ll.LLMatcher(self.tok, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return grammar

    def batch(self, grammar, tokens: list[int], size: int) -> list[float]:
        import llguidance.torch as lt

        matchers = [self.ll.LLMatcher(self.tok, grammar, log_level=0) for _ in range(size)]
        bitmask = lt.allocate_token_bitmask(size, self.vocab_size)
        executor = self.ll.LLExecutor()
        for i, m in enumerate(matchers):
            m.consume_tokens(tokens[:i % len(tokens)])
        times = []
        for step in range(len(tokens) // 2):
            t0 = time.perf_counter()
            lt.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
            times.append(time.perf_counter() - t0)
            for i, m in enumerate(matchers):
                m.consume_token(tokens[(i + step) % len(tokens)]) or m.reset()
        return times

    def walk(self, grammar, tokens: list[int]) -> tuple[list[float], list[float]]:
        import llguidance.torch as lt

        matcher = self.ll.LLMatcher(self.tok, grammar, log_level=0)
        bitmask = lt.allocate_token_bitmask(1, self.vocab_size)
        masks, accepts = [], []
        for token in tokens:
            t0 = time.perf_counter()
            lt.fill_next_token_bitmask(matcher, bitmask, 0)
            t1 = time.perf_counter()
            ok = matcher.consume_token(token)
            t2 = time.perf_counter()
            assert ok, f"llguidance rejected token {token}: {matcher.get_error()}"
            masks.append(t1 - t0)
            accepts.append(t2 - t1)
        return masks, accepts


def xgrammar_tool_grammar(required: bool) -> dict:
    tags = [{"type": "tag", "begin": f'<tool_call>\n{{"name": "{t["name"]}", "arguments": ',
             "content": {"type": "json_schema", "json_schema": t["parameters"]}, "end": "}\n</tool_call>"}
            for t in TOOLS]
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<tool_call>"],
                                                 "tags": tags, "at_least_one": required}}


def llguidance_tool_grammar(required: bool) -> str:
    """The same language in llguidance's Lark: free text, then calls opened by <tool_call>."""
    rules, alts = [], []
    for i, t in enumerate(TOOLS):
        alts.append(f"call_{i}")
        rules.append(f'call_{i}: "{{\\"name\\": \\"{t["name"]}\\", \\"arguments\\": " %json '
                     f'{json.dumps(t["parameters"])} "}}"')
    body = "\n".join(rules)
    calls = " | ".join(alts)
    if required:
        start = 'start: (call "\\n")+\ncall: <tool_call> "\\n" (' + calls + ') "\\n" </tool_call>'
    else:
        start = ('start: TEXT (call TEXT)*\nTEXT: /(.|\\n)*/\n'  # lazy: the text ends at the trigger
                 'call: <tool_call> "\\n" (' + calls + ') "\\n" </tool_call>')
    return json.dumps({"grammars": [{"lark_grammar": start + "\n" + body}]})


def run(args) -> dict:
    big = build_big_tokenizer(args.big_tokenizer)
    report = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": os.cpu_count(), "cases": []}
    for tok_name, path in (("demo (4,096)", DEMO), ("qwen3-size (151,669)", big)):
        tokenizer = load_tokenizer(path)
        vocab = len(tokenizer)
        texts = {"json_schema": SCHEMA_TEXT, "tool_call_auto": AUTO_TEXT, "tool_call_required": CALL_TEXT + "\n"}
        for lib_class in (XGrammar, LLGuidance):
            lib = lib_class(tokenizer, vocab)
            for case, text in texts.items():
                tokens = tokenizer.encode(text, add_special_tokens=False)
                if lib.name == "xgrammar":
                    kind, spec = ("json", SCHEMA) if case == "json_schema" else \
                        ("tag", xgrammar_tool_grammar(case.endswith("required")))
                else:
                    kind, spec = ("json", SCHEMA) if case == "json_schema" else \
                        ("lark", llguidance_tool_grammar(case.endswith("required")))
                t0 = time.perf_counter()
                compiled = lib.compile(kind, spec)
                compile_s = time.perf_counter() - t0
                masks, accepts = [], []
                for _ in range(args.repeat):
                    m, a = lib.walk(compiled, tokens)
                    masks += m
                    accepts += a
                row = {"tokenizer": tok_name, "library": lib.name, "grammar": case, "setup_ms": round(1e3 * lib.setup_s, 1),
                       "compile_ms": round(1e3 * compile_s, 1), "mask": _stats(masks), "accept": _stats(accepts),
                       "batch32_step": _stats(lib.batch(compiled, tokens, 32))}
                report["cases"].append(row)
                print(f"{tok_name:22} {lib.name:10} {case:18} setup {row['setup_ms']:8.1f} ms  compile "
                      f"{row['compile_ms']:8.1f} ms  mask mean {row['mask']['mean_us']:8.1f} us p99 "
                      f"{row['mask']['p99_us']:8.1f} max {row['mask']['max_us']:8.1f}  accept mean "
                      f"{row['accept']['mean_us']:6.1f} us  batch-32 step mean {row['batch32_step']['mean_us']:8.1f} us", flush=True)
    return report


def random_walks(tokenizer_dir: Path, batch: int, steps: int = 60) -> dict:
    """The masks of `batch` requests taking random allowed tokens, per step: by the engine's
    `Grammars.masks`, each row's `fill_next_token_bitmask` in turn, xgrammar's batch matcher with
    1, 2, 4, 8, 16 threads, and as many Python threads (the call releases the GIL). Each variant
    walks from the start with the same seed, so all see the same states, each state first after
    its token was accepted (a second fill of a state is faster)."""
    import types
    from concurrent.futures import ThreadPoolExecutor

    import xgrammar as xgr

    from hibana_bench.grammar_overhead import SCHEMA
    from hibana_core import SamplingParams
    from hibana_core.grammar import Grammars, fill_threads

    tokenizer = load_tokenizer(tokenizer_dir)
    vocab = len(tokenizer)
    grammars = Grammars(tokenizer, vocab, [tokenizer.eos_token_id or 0], torch.device("cpu"))
    params = SamplingParams(max_tokens=steps, ignore_eos=True, json_schema=SCHEMA)
    bits = torch.arange(32, dtype=torch.int32)
    bitmask = torch.empty(batch, grammars.width, dtype=torch.int32)

    def walk(fill) -> list[float]:
        requests = [types.SimpleNamespace(grammar=grammars.matcher(params, []), finished=False)
                    for _ in range(batch)]
        scheduled = types.SimpleNamespace(sampling=[types.SimpleNamespace(request=r, draft_token_ids=())
                                                    for r in requests])
        matchers = [r.grammar._matcher for r in requests]
        rng, times = random.Random(0), []
        for _ in range(steps):
            start = time.perf_counter()
            masks = fill(scheduled, matchers)
            times.append(time.perf_counter() - start)
            for i, r in enumerate(requests):
                allowed = torch.nonzero(((masks[i].unsqueeze(-1) >> bits) & 1).flatten()).flatten()
                allowed = allowed[allowed < vocab]
                if not r.grammar.done and len(allowed):
                    r.grammar.accept(int(allowed[rng.randrange(len(allowed))]))
        return times

    def rows(matchers, chosen) -> None:
        for i in chosen:
            matchers[i].fill_next_token_bitmask(bitmask, i)

    def serial(scheduled, matchers):
        rows(matchers, range(batch))
        return bitmask

    variants = {f"Grammars.masks ({fill_threads()} threads)": lambda scheduled, _: grammars.masks(scheduled, batch).bitmask,
                "serial": serial}
    for n in (1, 2, 4, 8, 16):
        pool, threads = xgr.BatchGrammarMatcher(max_threads=n), ThreadPoolExecutor(n)

        def pooled(scheduled, matchers, pool=pool):
            pool.batch_fill_next_token_bitmask(matchers, bitmask)
            return bitmask

        def threaded(scheduled, matchers, n=n, threads=threads):
            list(threads.map(lambda k: rows(matchers, range(k, batch, n)), range(n)))
            return bitmask

        variants[f"xgrammar pool {n}"], variants[f"python threads {n}"] = pooled, threaded
    report = []
    for name, fill in variants.items():
        row = {"variant": name, "batch": batch, "step": _stats(walk(fill)[5:])}
        report.append(row)
        print(f"walks {batch:3d}  {name:28s} per step mean {row['step']['mean_us'] / 1e3:7.3f} ms  p50 "
              f"{row['step']['p50_us'] / 1e3:7.3f} ms  max {row['step']['max_us'] / 1e3:7.3f} ms", flush=True)
    return {"cpu": os.cpu_count(), "walks": report}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hibana_bench.grammar_libs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--big-tokenizer", type=Path, default=Path("/tmp/hibana-qwen3-size-tokenizer"),
                        help="directory of the 151k tokenizer (built there when missing)")
    parser.add_argument("--repeat", type=int, default=5, help="walks per case (a fresh matcher each)")
    parser.add_argument("--walks", type=int, metavar="B",
                        help="only the random walks of B requests (see above)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    report = random_walks(build_big_tokenizer(args.big_tokenizer), args.walks) if args.walks else run(args)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
