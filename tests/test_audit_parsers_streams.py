"""Audit (parsers): the tool-call streams of every family say what a whole parse says, for any
chunking of the generated text, malformed calls included."""

from __future__ import annotations

import json

import pytest

from hibana_plugins.hookspecs import GeneratedText, ToolCallDelta
from hibana_plugins.tool_parsers import GraniteToolParser, MistralToolParser


def generated(pieces: list[tuple[str, bool]]) -> list[GeneratedText]:
    """One GeneratedText a piece (a token: control or not); the whole text is their join."""
    return [GeneratedText(text, ((0, len(text)),) if control else ()) for text, control in pieces]


def joined(chunks: list[GeneratedText]) -> GeneratedText:
    text, spans = "", []
    for chunk in chunks:
        spans += [(len(text) + a, len(text) + b) for a, b in chunk.control_spans]
        text += chunk
    return GeneratedText(text, tuple(spans))


def streamed(parser, chunks):
    stream, text, calls = parser.stream(), [], {}
    for piece in [p for chunk in chunks for p in stream.feed(chunk)] + stream.close():
        if isinstance(piece, ToolCallDelta):
            call = calls.setdefault(piece.index, [None, ""])
            call[0] = piece.name or call[0]
            call[1] += piece.arguments_fragment
        else:
            text.append(str(piece))
    output = stream.finish()
    return "".join(text), [(n, json.loads(a)) for n, a in calls.values()], output


CALL = '[{"name": "f", "arguments": {"a": 1}}]'


@pytest.mark.parametrize("parser, pieces, content", [
    # a malformed array, then real calls: the later calls were lost to content when the whole text
    # was parsed at once, and streamed when it came token by token
    (MistralToolParser(), [("[TOOL_CALLS]", True), ('["oops"] then ', False), ("[TOOL_CALLS]", True), (CALL, False)],
     '[TOOL_CALLS]["oops"] then'),
    (MistralToolParser(), [("[TOOL_CALLS]", True), ('[{"name": "g", "arguments": 1}] ', False),
                           ("[TOOL_CALLS]", True), (CALL, False)],
     '[TOOL_CALLS][{"name": "g", "arguments": 1}]'),
    (GraniteToolParser(), [("<|tool_call|>", True), ("oops ", False), ("<|tool_call|>", True), (CALL, False)],
     "<|tool_call|>oops"),
], ids=["mistral-array", "mistral-arguments", "granite"])
def test_a_malformed_call_then_a_call_streams_as_it_parses(parser, pieces, content):
    chunks = generated(pieces)
    by_character = [GeneratedText(c, ((0, len(c)),) if control else ()) for text, control in pieces
                    for c in ([text] if control else list(text))]
    whole = parser.parse(joined(chunks))
    assert [(c.name, c.arguments) for c in whole.tool_calls] == [("f", {"a": 1})]
    assert whole.content == content and whole.error
    for chunking in ([joined(chunks)], chunks, by_character):
        text, calls, output = streamed(parser, chunking)
        assert (text, calls) == (output.content, [("f", {"a": 1})]) and output.content == content


def test_a_malformed_named_call_keeps_its_whitespace_in_the_content():
    """The whitespace after [ARGS] was dropped from the content of a call that proved malformed
    (and kept when it came in its own chunk)."""
    parser = MistralToolParser()
    pieces = [("[TOOL_CALLS]", True), ("f", False), ("[ARGS]", True), ("\n oops", False)]
    whole = parser.parse(joined(generated(pieces)))
    assert whole.tool_calls == [] and whole.content == "[TOOL_CALLS]f[ARGS]\n oops" and whole.error
    assert streamed(parser, generated(pieces))[0] == whole.content


def test_a_python_tag_spelled_by_ordinary_tokens_is_content_not_a_call(tmp_path):
    """Llama 3's `<|python_tag|>` opens calls as the control token only: a model quoting a tool
    result that holds its text (ordinary tokens) wrote no call; the llama3_json parser read one,
    where the mistral, granite and harmony parsers keep their spelled markers as content."""
    import tiny_models
    from test_chat import HELLO, LLAMA3_TEMPLATE, WEATHER, _llama3_checkpoint, streamed_turn
    from test_harmony import spelled_ids

    from hibana_core import SamplingParams
    from hibana_core.chat import Chat
    from hibana_core.speculation import force_outputs

    call = '{"name": "get_weather", "parameters": {"city": "Rome"}}'
    with tiny_models.open_engine(_llama3_checkpoint(tmp_path, LLAMA3_TEMPLATE)) as llama:
        for n, (spelled, calls) in enumerate([(True, []), (False, [("get_weather", {"city": "Rome"})])]):
            pieces = ["It said: ", "<|python_tag|>", call] if spelled else ["It said: <|python_tag|>" + call]
            ids = spelled_ids(llama.tokenizer, pieces) + llama.tokenizer.encode("<|eot_id|>", add_special_tokens=False)
            text = "It said: <|python_tag|>" + call if spelled else "It said:"
            for stream in (False, True):
                chat = Chat(llama, f"tag-{n}-{stream}")
                force_outputs(chat.handle, ids)
                params = SamplingParams(max_tokens=len(ids))
                if stream:
                    streamed_text, streamed_calls, result = streamed_turn(list(chat.stream_respond(HELLO, [WEATHER],
                                                                                                   params)))
                    assert (streamed_text, [(name, a) for _, name, a in streamed_calls]) == (text, calls)
                else:
                    result = chat.respond(HELLO, [WEATHER], params)
                assert (result.text, [(c.name, c.arguments) for c in result.tool_calls]) == (text, calls)
        # a call cut by max_tokens after the tag is what an adapter reports as an invalid call: its name
        # and the arguments it had begun (it was ("", "") for a call the tag opened)
        cut = Chat(llama).cut_call_parts('<|python_tag|>{"name": "get_weather", "parameters": {"ci')
        assert cut == ("get_weather", '{"ci')


def test_the_llama3_parser_reads_a_spelled_python_tag_as_text():
    from hibana_plugins.tool_parsers import Llama3JsonToolParser

    call = '{"name": "f", "parameters": {}}'
    quoted = GeneratedText("See <|python_tag|>" + call, ())
    for chunks in ([quoted], [GeneratedText(c, ()) for c in quoted]):
        text, calls, output = streamed(Llama3JsonToolParser(), chunks)
        assert (text, calls, output.content) == (quoted, [], quoted)
    real = GeneratedText("See <|python_tag|>" + call, ((4, 18),))
    assert [c.name for c in Llama3JsonToolParser().parse(real).tool_calls] == ["f"]
    assert [c.name for c in Llama3JsonToolParser().parse("See <|python_tag|>" + call).tool_calls] == ["f"]  # a str


@pytest.mark.parametrize("text", [
    '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}, "id": "aaaaaaaaa"}, '
    '{"name": "f", "arguments": {"a": 2}, "id": "aaaaaaaaa"}]',
    '[TOOL_CALLS]f[CALL_ID]aaaaaaaaa[ARGS]{"a": 1}[TOOL_CALLS]f[CALL_ID]aaaaaaaaa[ARGS]{"a": 2}',
], ids=["array", "call_id"])
def test_a_call_id_the_model_wrote_twice_in_a_turn_is_kept_once(text):
    """Mistral's calls may carry the model's own id; two calls of one turn with the same id went
    out with it both (ToolCall ids are unique per call: the results are paired with them by id)."""
    whole = MistralToolParser().parse(text)
    ids = [c.id for c in whole.tool_calls]
    assert [c.arguments for c in whole.tool_calls] == [{"a": 1}, {"a": 2}]
    assert ids[0] == "aaaaaaaaa" and ids[1] != ids[0] and len(ids[1]) == 9 and ids[1].isalnum()
    _, calls, output = streamed(MistralToolParser(), list(text))
    assert [c.id for c in output.tool_calls][0] == "aaaaaaaaa" and len({c.id for c in output.tool_calls}) == 2


def _schemas(node) -> list:
    """The json_schema contents of a structural tag, wherever they stand."""
    if isinstance(node, dict):
        own = [node["json_schema"]] if node.get("type") == "json_schema" else []
        return own + [s for key, value in node.items() if key != "json_schema" for s in _schemas(value)]
    if isinstance(node, list):
        return [s for value in node for s in _schemas(value)]
    return []


@pytest.mark.parametrize("name", ["mistral", "mistral_args", "mistral_call_id", "granite", "harmony", "hermes"])
def test_guided_false_frees_the_arguments_of_a_format_that_builds_its_own_grammar(name):
    """guided=False (guided_tool_arguments) leaves a call's arguments any JSON object; the formats
    that build their own grammar (mistral's, granite's, harmony's) held them to the schema all the same."""
    from hibana_core.turn import ANY_OBJECT, parser_grammar
    from hibana_plugins.manager import get_plugin_manager

    parser = get_plugin_manager().tool_parsers()[name]
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 5}}, "required": ["city"]}}}
    for choice in ("auto", "required", "get_weather"):
        held = _schemas(parser_grammar(parser, name, [tool], choice))
        free = _schemas(parser_grammar(parser, name, [tool], choice, strict=False))
        assert held and all(s == tool["function"]["parameters"] for s in held), held
        assert free and all(s == ANY_OBJECT for s in free), free
