"""Grammar-constrained decoding: JSON schemas, regexes, grammars and tool calls as token masks.

    submit    SamplingParams(json_schema= | regex= | grammar=) -> Grammars.matcher: compiled once
              per grammar (cached), a Matcher per request; a bad one is a GrammarError for that call
    schedule  drafts are cut at the first token the request's matcher rejects (`Matcher.valid_prefix`)
    step N    forward N enqueued -> step N-1's tokens read back, each kept token advances its
              matcher -> `Grammars.masks`: one mask per constrained row of N (and per verified
              position of a draft) filled on the host, copied to the device -> the sampler adds
              -inf where a mask forbids -> `Matcher.done` ends the request
    (the masks are computed while the device runs the forward: no synchronisation is added)

A matcher allows the request's stop tokens (end of sequence, end of turn, the caller's) only where
its grammar is complete, so a constrained output ends complete unless max_tokens cuts it. A stop
token is never taken as text but where the grammar names it by a `token` format (harmony's
<|call|> is the text that ends its message, and the stop): "a" for regex "xa" would end the output
at "x"; where the grammar needs such a token, the request fails with a GrammarError. The tokenizer's
control tokens (its special tokens) are never allowed inside a grammar, except where a structural
tag names one by a `token` format (by id or by its text: harmony's markup, `hibana_plugins.harmony`):
then there, and nowhere else that text goes, since no text can spell it (`UNSPELLABLE`); the tag's
own token-level wildcards (`any_tokens`) take it too, as they take any token but the other control
tokens. JSON is compact, spaced as `json.dumps` writes it (", ", ": "): small models do not wander
into whitespace.

Where the grammar forces a string (a key, the JSON around values, a tool's name once chosen), the
mask allows only the first token of the tokenizer's own spelling of it: the model then reads the
tokens it was trained on, not a spelling of its choosing ('h' 'an' 'd' 'o' 'ff' for "handoff"),
which throws a small model off. The last token of a forced string stays free among the grammar's
(it may merge with what follows, as `{"` does).

Why xgrammar (and not llguidance). Both are maintained, both roll back (speculation) and both
take JSON schemas, regexes and grammars. Measured on this machine's CPU (2 cores,
`python -m hibana_bench.grammar_libs`, bench/RESULTS.md), mask time per token, mean:

    tokenizer             grammar         xgrammar   llguidance
    demo (4,096)          JSON schema       2.7 us      16.9 us
    demo (4,096)          tool calls        2.0 us      16.2 us
    qwen3-size (151,669)  JSON schema      67.5 us      33.7 us
    qwen3-size (151,669)  tool calls       63.6 us      36.9 us
    batch 32, one step:   demo 40-50 us against 500-750 us; 151k 1.7-2.8 ms against 1.4-1.9 ms

llguidance is ~2x faster per token on a Qwen3-size vocabulary and compiles nothing up front
(xgrammar: 28 ms for the schema, 120 ms for a four-tool grammar, once per distinct grammar, cached
and off the step loop: the compile drops the GIL); xgrammar is 6-8x faster on the demo workload,
where the CPU target (< 10% overhead) is tight. Fit decided it: xgrammar's structural tags say
"free text, and a tool call once `<tool_call>` appears" (or "calls only, from the first token";
at least one; stop after the first) in one declarative value that a tool-call parser plugin can
supply as it is; it has the completeness state (`is_completed`), the forced strings
(`find_jump_forward_string`) and the batched, multi-threaded mask filling the engine uses, and it
is what vLLM and SGLang use by default. On the GPU the per-token time hides under the forward
either way (measured there with `hibana bench grammar --model qwen3-8b`).

The masks are applied by the sampler (`Sampler.apply_masks`): each byte of a row's bitmask indexes
a table of eight 0 / -inf biases, one gather for the whole batch on CPU or GPU (up to 5x faster on the
CPU than xgrammar's own kernel, and no per-call host synchronisation).

The package, one module per concern (constants are read in the module that defines them: patch
them there):

    grammars.py     `Grammars`: the tokenizer as xgrammar reads it, the compiled-grammar cache,
                    a Matcher per request, each step's masks (on a worker thread)
    matcher.py      `Matcher`: one request's place in its grammar and its rows of a step's mask
    bitmask.py      bits of the int32 token bitmasks
    utf8.py         tokens whose bytes can be in no UTF-8 text, or spell no character after a lead byte
    json_schema.py  a JSON schema as an xgrammar Grammar for compact JSON, and the EBNF repairs it needs
    opened.py       a JSON schema rewritten as xgrammar must read it to hold what JSON Schema says
    satisfiable.py  schemas and grammars that allow no value, or no finite one
    keywords.py     what a schema asks that the grammar cannot hold (`unenforced_keywords`, `check_held`)
    one_of.py       whether two subschemas exclude each other (xgrammar holds oneOf as anyOf)
    regex.py        regexes as the grammar holds them (`held_regex`, `unenforced_regex`)
    schema.py       walking a JSON schema: subschemas, pointers, a value's JSON types
    backend.py      importing xgrammar, and its error messages
"""

from __future__ import annotations

from hibana_core.grammar.bitmask import allowed_tokens
from hibana_core.grammar.grammars import (BATCH_FILL_ROWS, CACHE_BYTES, CACHE_SIZE, MAX_FILL_THREADS,
                                          SPELLINGS_CACHED, STAGING_BUFFERS, UNSPELLABLE, Grammars, fill_threads)
from hibana_core.grammar.json_schema import (MAX_EXPONENT_DIGITS, MAX_FRACTION_DIGITS, MAX_NUMBER_DIGITS,
                                             compact_json_tag, json_schema_grammar)
from hibana_core.grammar.keywords import (HELD_FORMATS, MULTIPLE_OF_MOST, MULTIPLE_OF_RANGE_MOST, UNENFORCED_KEYWORDS,
                                          UNHELD_FORMATS, check_held, unenforced_keywords)
from hibana_core.grammar.matcher import FORCED_MAX_WORDS, SPELLED_CHARS, VERIFY_MAX, Matcher
from hibana_core.grammar.one_of import EXCLUSIVE_DEPTH
from hibana_core.grammar.regex import held_regex, raw_in_json_string, unenforced_regex
from hibana_core.grammar.satisfiable import (RANGE_DECIMALS, rules_without_finite_string, unsatisfiable,
                                             unwritable_ranges, without_finite_value)
from hibana_core.grammar.schema import subschemas
from hibana_core.grammar.utf8 import Utf8Rows, _never_utf8

__all__ = [
    "BATCH_FILL_ROWS", "CACHE_BYTES", "CACHE_SIZE", "EXCLUSIVE_DEPTH", "FORCED_MAX_WORDS", "HELD_FORMATS",
    "MAX_EXPONENT_DIGITS", "MAX_FILL_THREADS", "MAX_FRACTION_DIGITS", "MAX_NUMBER_DIGITS", "MULTIPLE_OF_MOST",
    "MULTIPLE_OF_RANGE_MOST", "RANGE_DECIMALS", "SPELLED_CHARS", "SPELLINGS_CACHED", "STAGING_BUFFERS",
    "UNENFORCED_KEYWORDS", "UNHELD_FORMATS", "UNSPELLABLE", "VERIFY_MAX",
    "Grammars", "Matcher", "Utf8Rows",
    "allowed_tokens", "check_held", "compact_json_tag", "fill_threads", "held_regex", "json_schema_grammar",
    "raw_in_json_string", "rules_without_finite_string", "subschemas", "unenforced_keywords", "unenforced_regex",
    "unsatisfiable", "unwritable_ranges", "without_finite_value",
    "_never_utf8",  # (tests/test_grammar.py)
]
