"""Audit (parsers 2): the control-token call formats (mistral, mistral_args, mistral_call_id,
granite) under tool_choice "none", calls cut by max_tokens, and parallel_tool_calls=False, as the
text formats (hermes, llama3_json) behave."""

from __future__ import annotations

import pytest

from hibana_core import SamplingParams
from hibana_core.chat import Chat

HELLO = [{"role": "user", "content": "Hello!"}]


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    import tiny_models
    from test_tool_parser_granite import GRANITE_MARKERS, GRANITE_TEMPLATE

    path = tiny_models.make_tiny_checkpoint("llama", tmp_path_factory.mktemp("granite"),
                                            vocab_size=tiny_models.VOCAB_SIZE + len(GRANITE_MARKERS))
    tokenizer = tiny_models.make_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": GRANITE_MARKERS})
    tokenizer.chat_template = GRANITE_TEMPLATE
    tokenizer.save_pretrained(path)
    with tiny_models.open_engine(path) as engine:
        yield engine


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    import tiny_models
    from test_chat import mistral_checkpoint

    with tiny_models.open_engine(mistral_checkpoint(tmp_path_factory.mktemp("mistral"))) as engine:
        yield engine


@pytest.mark.parametrize("model, parser, marker", [
    ("granite", "granite", "<|tool_call|>"), ("mistral", "mistral", "[TOOL_CALLS]"),
    ("mistral", "mistral_args", "[TOOL_CALLS]"), ("mistral", "mistral_call_id", "[TOOL_CALLS]")])
def test_tool_choice_none_holds_the_model_off_the_calls_marker(request, model, parser, marker):
    """"none" lists the tools and keeps the model from opening a call, as hermes' grammar refuses
    its `<tool_call>`: these formats built no grammar for "none", so a model that wrote its calls
    marker (here pushed to it by logit_bias) had it in the answer's content."""
    from test_tool_parser_granite import WEATHER

    engine = request.getfixturevalue(model)
    token = engine.tokenizer.get_vocab()[marker]
    params = SamplingParams(max_tokens=8, logit_bias={token: 50})
    chat = Chat(engine, f"none-{parser}", tool_parser=parser)
    free = chat.respond(HELLO, [WEATHER], params, tool_choice="auto")
    assert free.raw_text.startswith(marker)  # what the bias makes of a turn that may call
    held = chat.respond(HELLO, [WEATHER], params, tool_choice="none")
    assert marker not in held.raw_text and held.content and not held.tool_calls
    assert held.usage.prompt_tokens == free.usage.prompt_tokens  # the tools are listed all the same


@pytest.mark.parametrize("model, parser", [
    ("granite", "granite"), ("mistral", "mistral"), ("mistral", "mistral_args"), ("mistral", "mistral_call_id")])
def test_a_call_cut_by_max_tokens_is_named(request, model, parser):
    """A forced call that max_tokens cut inside its arguments: `Chat.cut_call_parts` (what the
    adapters report as an invalid call, and a structured answer shows) gave ("", "") for these
    formats, which have no `call_syntax`; hermes and llama3_json name the call and its begun arguments."""
    from test_tool_parser_granite import WEATHER

    engine = request.getfixturevalue(model)
    chat = Chat(engine, f"cut-{parser}", tool_parser=parser)
    whole = chat.respond(HELLO, [WEATHER], SamplingParams(max_tokens=80, logprobs=True), tool_choice="required")
    assert whole.tool_calls, whole.raw_text
    ids = [lp.token_id for lp in whole.logprobs]  # cut two tokens into the arguments
    begun = next(n for n in range(len(ids)) if "{" in engine.tokenizer.decode(ids[:n]).partition("get_weather")[2])
    result = chat.respond(HELLO, [WEATHER], SamplingParams(max_tokens=begun + 1), tool_choice="required")
    assert result.finish_reason == "length" and result.cut_call and not result.tool_calls, result.raw_text
    name, arguments = chat.cut_call_parts(result.cut_call)
    assert name == "get_weather" and arguments.startswith("{") and result.raw_text.endswith(arguments), result.raw_text


@pytest.mark.parametrize("parser, cut, parts", [
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"ci', ("get_weather", '{"ci')),
    ("mistral", ', {"name": "get_weather", "arguments": {"city": "Oslo"}, "i', ("get_weather", '{"city": "Oslo"}')),
    ("mistral", '[TOOL_CALLS][{"name": "get_wea', ("get_wea", "")),
    ("mistral", '[TOOL_CALLS][{"na', ("", "")),
    ("mistral", "[TOOL_CALLS]", ("", "")),
    ("mistral", "[TOOL_CA", ("", "")),
    ("mistral_args", '[TOOL_CALLS]get_weather[ARGS] {"ci', ("get_weather", '{"ci')),
    ("mistral_args", "[TOOL_CALLS]get_weather[AR", ("get_weather", "")),
    ("mistral_call_id", '[TOOL_CALLS]get_weather[CALL_ID]abc123def[ARGS]{"ci', ("get_weather", '{"ci')),
    ("mistral_call_id", "[TOOL_CALLS]get_weather[CALL_ID]abc", ("get_weather", "")),
    ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {"ci', ("get_weather", '{"ci')),
    ("granite", "<|tool_call|>get_weather[ARGS]{", ("", "")),  # Mistral's named form is no Granite call
])
def test_cut_call_parts_of_each_form(parser, cut, parts):
    from hibana_plugins.manager import get_plugin_manager

    assert get_plugin_manager().lookup("tool_parser", parser).cut_call_parts(cut) == parts


CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
SECOND = CALL.replace("Paris", "Oslo")
ONE_CALL_OUTPUTS = [  # (parser, [(text, is a control token)]): the first call, then text or more calls
    ("hermes", [("A <tool_call>\n" + CALL + "\n</tool_call> between <tool_call>\n" + SECOND + "\n</tool_call>", False)]),
    ("hermes", [("<tool_call>\n" + CALL + "\n</tool_call>\n<tool_call>\n{\"name\": 1}\n</tool_call> after", False)]),
    ("llama3_json", [(CALL + "; " + SECOND + " trailing", False)]),
    ("mistral", [("A ", False), ("[TOOL_CALLS]", True), ("[" + CALL + ", " + SECOND + "] after", False)]),
    ("mistral", [("[TOOL_CALLS]", True), ("[" + CALL + "] mid ", False), ("[TOOL_CALLS]", True), (SECOND, False)]),
    ("mistral_args", [("A ", False), ("[TOOL_CALLS]", True), ("get_weather", False), ("[ARGS]", True),
                      ('{"city": "Paris"} mid ', False), ("[TOOL_CALLS]", True), ("get_weather", False),
                      ("[ARGS]", True), ('{"city": "Os', False)]),
    ("granite", [("A ", False), ("<|tool_call|>", True), ("[" + CALL + ", {\"name\": ", False)]),
]


class SpannedHandle:
    """A state whose request streams `chunks` (GeneratedText: control tokens' spans told, as the
    engine's events tell them), then finishes."""

    def __init__(self, chunks) -> None:
        self.id, self.tokens, self.chunks = "scripted", [], chunks

    def stream(self, params, *, prompt=None):
        from scripted import ScriptedEvents

        from hibana_core.state import StreamEvent

        class Spanned(ScriptedEvents):
            def __iter__(self):
                for event in super().__iter__():
                    chunk = self.chunks[self.sent - 1] if event.token_id is not None else None
                    yield event if chunk is None else StreamEvent(0, str(chunk), control_spans=chunk.control_spans)
        return Spanned(self.chunks)

    def astream(self, params, *, prompt=None, loop=None):
        return self.stream(params, prompt=prompt)


def chunked(pieces, cuts):
    """The generated text of `pieces` cut at `cuts` (a control token's text is never cut)."""
    from hibana_plugins.hookspecs import GeneratedText

    text, spans = "", []
    for piece, control in pieces:
        spans += [(len(text), len(text) + len(piece))] if control else []
        text += piece
    cuts = [c for c in cuts if not any(a < c < b for a, b in spans)]
    return [GeneratedText(text[a:b], tuple((x - a, y - a) for x, y in spans if a <= x and y <= b))
            for a, b in zip([0, *cuts], [*cuts, len(text)]) if b > a]


@pytest.mark.parametrize("parser, pieces", ONE_CALL_OUTPUTS, ids=[p for p, _ in ONE_CALL_OUTPUTS])
def test_one_call_turn_is_the_same_however_the_output_is_chunked(mistral, parser, pieces):
    """parallel_tool_calls=False: the turn ends at its first call, so what follows that call is no
    part of it. It was read up to the end of the chunk (an event's text) the call ended in: the
    text after the call became content, or a second call begun there ended the turn as a
    malformed or cut call (finish_reason malformed_tool_call beside the call), as the chunks fell."""
    import random

    from test_chat import streamed_turn
    from test_tool_parser_granite import WEATHER

    total = sum(len(p) for p, _ in pieces)
    rng = random.Random(7)
    chunkings = [chunked(pieces, []), chunked(pieces, range(total))]
    chunkings += [chunked(pieces, sorted(rng.sample(range(1, total), 3))) for _ in range(6)]
    chat = Chat(mistral, tool_parser=parser)
    seen = set()
    for chunks in chunkings:
        result = chat.on(SpannedHandle(chunks)).respond(HELLO, [WEATHER], parallel_tool_calls=False)
        text, calls, streamed = streamed_turn(list(chat.on(SpannedHandle(chunks)).stream_respond(
            HELLO, [WEATHER], parallel_tool_calls=False)))
        assert text == streamed.text and [(n, a) for _, n, a in calls] == [(c.name, c.arguments)
                                                                             for c in streamed.tool_calls]
        for r in (result, streamed):
            seen.add((r.text, tuple((c.name, str(c.arguments)) for c in r.tool_calls), r.finish_reason, r.error))
    assert seen == {("A" if pieces[0][0].startswith("A ") else "",
                     (("get_weather", "{'city': 'Paris'}"),), "tool_calls", None)}
