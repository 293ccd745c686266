"""qwen3_coder, tried as a new user would: what the grammar lets a model write, the parser reads,
whole and streamed alike (names with spaces or '>', code whose text holds the call's markup)."""

from __future__ import annotations

import json

import pytest

from hibana_core.turn import SYNTAX, tool_call_grammar
from hibana_plugins.hookspecs import ToolCallDelta
from hibana_plugins.qwen_xml import QwenXmlToolParser

TOOL = {"type": "function", "function": {"name": "edit file", "parameters": {"type": "object", "properties": {
    "code": {"type": "string"}, "x>y": {"type": "string"}, "e f": {"type": "string"}, " pad": {"type": "string"},
    "c.d": {"type": "integer"}, "a-b": {"type": "boolean"}}}}}
OTHER = {"type": "function", "function": {"name": "w", "parameters": {"type": "object", "properties": {
    "n": {"type": "integer"}}}}}


def block(name: str, **params: str) -> str:
    lines = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in params.items())
    return f"<tool_call>\n<function={name}>\n{lines}</function>\n</tool_call>"


CASES = [
    (block("edit file", **{"x>y": "w", "e f": "v", " pad": "q", "c.d": "4", "a-b": "true"}),  # the schema's order
     {"x>y": "w", "e f": "v", " pad": "q", "c.d": 4, "a-b": True}),
    (block("edit file", code="if a<b and c>d:\n    s = '<parameter=n>' + \"</tool_call>\" + '</function>'"),
     {"code": "if a<b and c>d:\n    s = '<parameter=n>' + \"</tool_call>\" + '</function>'"}),
    (block("edit file", code="print('</function>\\n</tool_call>')  # ok"),
     {"code": "print('</function>\\n</tool_call>')  # ok"}),
]


def accepted_by_grammar(text: str, tools: list[dict] = (TOOL, OTHER), syntax: str = "qwen3_coder") -> bool:
    """Whether the turn's call grammar, as the engine compiles it, lets a model write `text`."""
    import xgrammar as xgr

    from hibana_core.grammar import compact_json_tag

    tag = compact_json_tag(tool_call_grammar(list(tools), "required", SYNTAX[syntax]))
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo([chr(c) for c in range(32, 127)] + ["\n"]))
    matcher = xgr.GrammarMatcher(compiler.compile_structural_tag(xgr.StructuralTag.from_json(json.dumps(tag))),
                                 terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_completed()


@pytest.mark.parametrize("text, arguments", CASES)
def test_what_the_grammar_writes_the_parser_reads_whole_and_streamed(text, arguments):
    """The grammar writes an offered tool's name and its parameters' names as they are (a space, a
    '>') and a string's text up to its </parameter> (code holding '<parameter=', '</tool_call>'):
    the parser read such a name as no name, 'x>y' as 'x', and cut a value at the markup it held."""
    assert accepted_by_grammar(text)
    parser = QwenXmlToolParser()
    whole = parser.parse("Sure. " + text, [TOOL, OTHER])
    assert whole.error is None and whole.content == "Sure."
    assert [(c.name, c.arguments) for c in whole.tool_calls] == [("edit file", arguments)]
    full = "Sure. " + text
    for size in (1, 2, 3, 7, 13):
        stream, calls = parser.stream([TOOL, OTHER]), {}
        pieces = [p for i in range(0, len(full), size) for p in stream.feed(full[i:i + size])] + stream.close()
        for piece in pieces:
            if isinstance(piece, ToolCallDelta):
                entry = calls.setdefault(piece.index, [piece.name, ""])
                entry[1] += piece.arguments_fragment
        assert "".join(p for p in pieces if isinstance(p, str)) == "Sure."
        assert [(n, json.loads(a)) for n, a in calls.values()] == [("edit file", arguments)]


def test_a_call_that_never_closed_its_function_ends_at_its_tool_call_end():
    """A block whose </function> never came still ends at its </tool_call> when another call
    follows (the end is looked for after </function> only within the block)."""
    text = "<tool_call>\n<function=w>\n<parameter=n>\n1</tool_call> then " + block("w", n="2")
    out = QwenXmlToolParser().parse(text, [TOOL, OTHER])
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("w", {"n": 2})]
    assert out.content.startswith("<tool_call>") and "</function>" in out.error


def test_the_whitespace_the_grammar_puts_around_a_constrained_value_is_no_part_of_it():
    """Around a value whose schema is more than a plain string (maxLength, a type list, a number)
    the grammar allows a whitespace character each side, any of four; only the template's newline
    was taken off, so a random model's " updat\t" broke its maxLength of 5. A plain string's text is
    all value (the grammar writes nothing around it)."""
    tool = {"type": "function", "function": {"name": "ls", "parameters": {"type": "object", "properties": {
        "short": {"type": "string", "maxLength": 5}, "maybe": {"type": ["string", "null"]},
        "n": {"type": "integer"}, "plain": {"type": "string"}}, "required": ["short", "maybe", "n", "plain"]}}}
    text = ("<tool_call>\n<function=ls>\n<parameter=short> updat\t</parameter>\n<parameter=maybe>\rParis "
            "</parameter>\n<parameter=n>\t7 </parameter>\n<parameter=plain> as is\t</parameter>\n</function>\n"
            "</tool_call>")
    assert accepted_by_grammar(text, [tool])
    out = QwenXmlToolParser().parse(text, [tool])
    assert [c.arguments for c in out.tool_calls] == [{"short": "updat", "maybe": "Paris", "n": 7, "plain": " as is\t"}]


def test_a_call_max_tokens_cut_is_named(coder):
    """A call max_tokens cut has the name and the arguments it had begun (what LangChain's
    invalid call and a structured answer show): the call syntax's reading split it at the newline
    after <tool_call>, so it had no name, ever."""
    from hibana_core import SamplingParams
    from hibana_core.chat import Chat
    from hibana_core.speculation import force_outputs

    text = block("w", n="12")
    ids = coder.tokenizer.encode(text, add_special_tokens=False)
    cut_at = len(coder.tokenizer.encode(text[:text.index("12") + 1], add_special_tokens=False))
    chat = Chat(coder, "cut")
    force_outputs(chat.handle, ids)
    result = chat.respond([{"role": "user", "content": "n"}], [OTHER], SamplingParams(max_tokens=cut_at))
    assert result.finish_reason == "length" and not result.tool_calls
    assert chat.cut_call_parts(result.cut_call, [OTHER]) == ("w", '{"n": 1')  # (JSON text: test_qwen_xml.py)
    assert chat.cut_call_parts("<tool_call>\n<function=ed") == ("ed", "")
    assert chat.cut_call_parts("<tool_call>\n<func") == ("", "")
    assert chat.cut_call_parts('<tool_call>\n{"name": "w", "arguments": {"n": 1') == ("w", '{"n": 1')


def test_a_list_without_items_takes_any_items():
    """A list parameter that says nothing of its items takes any, as JSON Schema has it: in the
    qwen_xml style xgrammar's strict mode held {"type": "array"} (in a type list or anyOf too) to
    [], and in both styles one with maxItems or uniqueItems (so Qwen3-Coder's call with tags
    ["x"] was refused mid-call: a GrammarError); the qwen_xml style's schema had none of the
    engine's other readings either (oneOf, draft 4's bounds, ...)."""
    tool = {"type": "function", "function": {"name": "tag", "parameters": {"type": "object", "properties": {
        "tags": {"type": "array"}, "few": {"type": "array", "maxItems": 3}, "maybe": {"type": ["array", "null"]},
        "one": {"oneOf": [{"type": "array", "uniqueItems": True}, {"type": "integer"}]}},
        "required": ["tags", "few", "maybe", "one"]}}}
    values = {"tags": '["x", 1]', "few": '[{"a": 1}, 2]', "maybe": '["y"]', "one": '["z", 2]'}
    assert accepted_by_grammar(block("tag", **values), [tool])
    assert not accepted_by_grammar(block("tag", **{**values, "few": "[1, 2, 3, 4]"}), [tool])
    hermes = '<tool_call>\n{"name": "tag", "arguments": {"tags": ["x", 1], "few": [{"a": 1}, 2], "maybe": ["y"], ' \
             '"one": ["z", 2]}}\n</tool_call>'
    assert accepted_by_grammar(hermes, [tool], "hermes")
    out = QwenXmlToolParser().parse(block("tag", **values), [tool])
    assert out.tool_calls[0].arguments == {k: json.loads(v) for k, v in values.items()}
