"""Reasoning models (issue 16): `reasoning` reaches the template as `enable_thinking`; the
thinking comes apart from the answer, in the result and while streaming, before tool-call
parsing; and KV reuse across two user turns under both history policies, on a tiny Qwen3-style
checkpoint whose template drops old thinking (its outputs forced, so that it thinks)."""

from __future__ import annotations

import dataclasses
import random

import pytest

from hibana_core import SamplingParams
from hibana_core.chat import Chat
from hibana_core.errors import ConfigError, GrammarError
from hibana_core.speculation import force_outputs
from hibana_core.turn import Thinking
from reasoning_model import OBSERVATION_QUERIES, make_reasoning_checkpoint

THOUGHT = "The user says hi. I should greet them."
ANSWER = "Hello there, friend."
OUTPUT = f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}<|im_end|>"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_reasoning_checkpoint(tmp_path_factory.mktemp("reasoning") / "qwen3-think")


@pytest.fixture
def engine(checkpoint, make_engine):
    return make_engine(checkpoint)


def force(engine, state_id: str, text: str) -> int:
    """The state's next generation writes `text`; returns its length in tokens."""
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    force_outputs(engine.open_state(state_id), ids)
    return len(ids)


def test_thinking_splits_however_the_text_is_cut():
    text = f"\n<think>\n{THOUGHT} </thin k>\n</think>\n\n{ANSWER} <think> stays"
    rng = random.Random(0)
    for _ in range(300):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, 12)))
        thinking = Thinking()
        pieces = [thinking.feed(text[a:b]) for a, b in zip([0, *cuts], [*cuts, len(text)])] + [thinking.close()]
        assert "".join(p[0] for p in pieces).strip() == f"{THOUGHT} </thin k>" == thinking.text
        assert "".join(p[1] for p in pieces) == f"{ANSWER} <think> stays"
    assert Thinking().feed("no thinking here") == ("", "no thinking here")
    opened = Thinking(open_in_prompt=True)
    assert [opened.feed("abc</th"), opened.feed("ink>\n\nok"), opened.close()] == [("abc", ""), ("", "ok"), ("", "")]


def test_reasoning_reaches_the_template(engine):
    chat = Chat(engine)
    messages = [{"role": "user", "content": "hi"}]
    assert chat.thinks
    assert chat.render_text(messages, reasoning=False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert chat.render_text(messages, reasoning=True).endswith("<|im_start|>assistant\n")
    assert chat.render_text(messages) == chat.render_text(messages, reasoning=True)
    with pytest.raises(ConfigError, match="reasoning must be"):
        chat.render_text(messages, reasoning="high")


def test_thinking_apart_in_respond_and_stream(engine):
    messages = [{"role": "user", "content": "hi"}]
    n = force(engine, "a", OUTPUT)
    result = Chat(engine, "a").respond(messages, params=SamplingParams(max_tokens=n))
    assert (result.reasoning, result.text) == (THOUGHT, ANSWER)
    assert result.raw_text == OUTPUT.removesuffix("<|im_end|>") or "<think>" in result.raw_text
    n = force(engine, "b", OUTPUT)
    deltas = list(Chat(engine, "b").stream_respond(messages, params=SamplingParams(max_tokens=n)))
    thinking = "".join(d.reasoning for d in deltas)
    assert thinking == THOUGHT and "<think>" not in thinking and "</think>" not in thinking
    assert "".join(d.text for d in deltas) == ANSWER
    # streamed, not at the end: ahead of the answer (in how many pieces is the reader's lag)
    assert max(i for i, d in enumerate(deltas) if d.reasoning) < min(i for i, d in enumerate(deltas) if d.text)
    assert deltas[-1].result.reasoning == THOUGHT and deltas[-1].result.text == ANSWER


def test_reuse_across_user_turns_under_both_policies(engine):
    """Turn 2 re-renders turn 1's reply without its thinking (the template's rule): "template"
    recomputes from the dropped block on; "generated" keeps the state's tokens."""
    first = [{"role": "user", "content": "hi"}]
    held, reused = {}, {}
    for policy in ("template", "generated"):
        n = force(engine, policy, OUTPUT)
        chat = Chat(engine, policy)
        result = chat.respond(first, params=SamplingParams(max_tokens=n), reasoning_history=policy)
        assert (result.reasoning, result.text) == (THOUGHT, ANSWER)
        held[policy] = len(chat.handle)
        second = first + [{"role": "assistant", "content": result.text, "reasoning_content": result.reasoning},
                          {"role": "user", "content": "and how are you?"}]
        again = chat.respond(second, params=SamplingParams(max_tokens=2), reasoning_history=policy)
        reused[policy] = again.usage.cached_tokens
        print(f"{policy}: turn 2 prompt {again.usage.prompt_tokens} tokens, {again.usage.cached_tokens} reused "
              f"of the {held[policy]} the state held")
    think_tokens = len(engine.tokenizer.encode(f"<think>\n{THOUGHT}\n</think>\n\n", add_special_tokens=False))
    assert reused["generated"] == held["generated"] - 1       # nothing recomputed (the last generated
                                                              # token's KV is computed by the next call)
    assert reused["template"] <= held["template"] - think_tokens  # cut at the dropped think block
    assert reused["template"] < reused["generated"]


def test_generated_history_leaves_out_the_replies_thinking_only(engine):
    """"generated" keeps the state where the prompt differs from it only by the replies' think
    blocks; a think block a user wrote is the conversation's text: edited, it is recomputed
    (a new user's trial saw the state keep the old question and the model answer it)."""
    n = force(engine, "edited", OUTPUT)
    chat = Chat(engine, "edited")
    first = [{"role": "user", "content": "Translate this: <think>attack at dawn</think>"}]
    result = chat.respond(first, params=SamplingParams(max_tokens=n), reasoning_history="generated")
    reply = {"role": "assistant", "content": result.text, "reasoning_content": result.reasoning}
    edited = [{"role": "user", "content": "Translate this: <think>retreat at noon</think>"}, reply,
              {"role": "user", "content": "Again, please."}]
    assert not chat.continues(chat.handle.tokens, chat.render_text(edited), "generated")
    again = chat.respond(edited, params=SamplingParams(max_tokens=1), reasoning_history="generated")
    held = engine.tokenizer.decode(chat.handle.tokens)
    shared = next(i for i, (a, b) in enumerate(zip(chat.prompt_ids(first), chat.prompt_ids(edited))) if a != b)
    assert "retreat at noon" in held and "attack at dawn" not in held and again.usage.cached_tokens <= shared
    unedited = [{"role": "user", "content": "Translate this: <think>retreat at noon</think>"}, reply,
                {"role": "user", "content": "Again, please."}, {"role": "assistant", "content": "x"},
                {"role": "user", "content": "Once more."}]
    assert chat.continues(chat.handle.tokens, chat.render_text(unedited), "generated")


def test_tool_calls_parse_after_thinking(engine, monkeypatch):
    from hibana_core.state import StateHandle
    from scripted import ScriptedEvents

    text = ('<think>\nMaybe <tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call> is wrong.\n</think>\n\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    monkeypatch.setattr(StateHandle, "stream", lambda self, params, prompt=None: ScriptedEvents(list(text)))
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    result = Chat(engine, "tools").respond([{"role": "user", "content": "weather?"}], tools)
    assert [(c.name, c.arguments) for c in result.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert "nope" in result.reasoning and result.finish_reason == "tool_calls" and result.error is None


@pytest.mark.parametrize("choice, opened", [("auto", False), ("required", False), ("auto", True)])
def test_tool_call_grammar_waits_for_the_thinking(engine, choice, opened):
    """The engine's tool-call grammar opens after the think block: `<tool_call>` written while
    thinking is thinking (the forced tokens would break the grammar otherwise: GrammarError)."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    thought = "Maybe <tool_call> is what I need, or not."
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    text = (f"{thought}\n</think>\n\n{call}<|im_end|>" if opened
            else f"<think>\n{thought}\n</think>\n\n{call}<|im_end|>")
    state = f"grammar-{choice}-{opened}"
    n = force(engine, state, text)
    chat = Chat(engine, state)
    prompt = chat.render_text([{"role": "user", "content": "weather in Paris?"}], tools)
    prompt += "<think>\n" if opened else ""   # a template that opens the think block itself
    result = chat.respond(prompt, tools, SamplingParams(max_tokens=n), tool_choice=choice)
    assert result.reasoning == thought
    assert [(c.name, c.arguments) for c in result.tool_calls] == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("opened", [False, True])
def test_a_prefill_that_closes_the_think_block_starts_the_call_grammar_after_it(engine, opened):
    """Skipping the thinking for one call by prefilling an empty think block (Qwen3's own off
    switch writes it) beside tools: the call grammar starts after the prefill, in the answer (it
    was a ConfigError: the grammar, waiting for a think block, held the turn from its first token)."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    state = f"skip-thinking-{opened}"
    n = force(engine, state, f"{call}<|im_end|>")
    chat = Chat(engine, state)
    prompt = chat.render_text([{"role": "user", "content": "weather in Paris?"}], tools)
    prompt += "<think>\n" if opened else ""
    prefill = "\n</think>\n\n" if opened else "<think>\n\n</think>\n\n"
    result = chat.respond(prompt, tools, SamplingParams(max_tokens=n), prefill=prefill)
    assert result.reasoning == "" and result.finish_reason == "tool_calls"
    assert [(c.name, c.arguments) for c in result.tool_calls] == [("get_weather", {"city": "Paris"})]
    # a prefill that leaves the block open still waits for it: refused, as before
    with pytest.raises(ConfigError, match="prefill"):
        chat.respond(prompt, tools, SamplingParams(max_tokens=n), prefill="<think>\nHmm")


@pytest.mark.parametrize("reply", ["json", "call"])
def test_an_answer_schema_beside_tools_waits_for_the_thinking(engine, reply):
    """A json_schema beside tools: after the think block and its blank line, a call or the answer
    in JSON under the schema (forced tokens the grammar refused would be a GrammarError)."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    thought = 'Maybe {"answer": 3} or <tool_call> will do.'
    body = ('{"answer": "sunny"}' if reply == "json"
            else '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    state = f"answer-{reply}"
    n = force(engine, state, f"<think>\n{thought}\n</think>\n\n{body}<|im_end|>")
    result = Chat(engine, state).respond([{"role": "user", "content": "weather in Paris?"}], tools,
                                         SamplingParams(max_tokens=n, json_schema=schema))
    assert result.reasoning == thought
    if reply == "json":
        assert result.text == body and not result.tool_calls and result.finish_reason == "stop"
    else:
        assert [(c.name, c.arguments) for c in result.tool_calls] == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("tools", ["no-tools", "none"])
def test_an_answer_schema_without_tools_waits_for_the_thinking(engine, tools):
    """response_format without tools (or with tool_choice "none") on a reasoning model: the think
    block first, then the answer under the schema (the schema held from the first token made the
    model skip its thinking, and a forced think block was a GrammarError)."""
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    thought = 'Maybe {"answer": 3} will do.'
    state = f"answer-only-{tools}"
    n = force(engine, state, f'<think>\n{thought}\n</think>\n\n{{"answer": "sunny"}}<|im_end|>')
    offered = {} if tools == "no-tools" else dict(tools=[{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object", "properties": {}}}}], tool_choice="none")
    result = Chat(engine, state).respond([{"role": "user", "content": "weather in Paris?"}],
                                         params=SamplingParams(max_tokens=n, json_schema=schema), **offered)
    assert (result.reasoning, result.text, result.finish_reason) == (thought, '{"answer": "sunny"}', "stop")


@pytest.mark.parametrize("kind", ["regex", "grammar"])
def test_a_regex_or_grammar_waits_for_the_thinking(engine, kind):
    """A caller's regex or EBNF grammar on a reasoning model holds the answer after the think block,
    as json_schema does (and vLLM's structured output after the reasoning): held from the first
    token, the model could not think, and forced thinking was a GrammarError."""
    thought = "Two digits, then the unit."
    n = force(engine, f"own-{kind}", f"<think>\n{thought}\n</think>\n\n42 km<|im_end|>")
    held = ({"regex": r"[0-9]{2} (km|mi)"} if kind == "regex"
            else {"grammar": 'root ::= [0-9] [0-9] " " ("km" | "mi")'})
    result = Chat(engine, f"own-{kind}").respond([{"role": "user", "content": "How far?"}],
                                                 params=SamplingParams(max_tokens=n, **held))
    assert (result.reasoning, result.text, result.finish_reason) == (thought, "42 km", "stop")
    # the answer itself is still held: a forced answer outside the regex fails that call alone
    force(engine, f"own-{kind}-bad", f"<think>\n{thought}\n</think>\n\nfar away<|im_end|>")
    with pytest.raises(GrammarError):
        Chat(engine, f"own-{kind}-bad").respond([{"role": "user", "content": "How far?"}],
                                               params=SamplingParams(max_tokens=n, **held))


def test_thinking_switched_off_holds_no_think_block(engine):
    """reasoning=False: the template writes an empty think block, so the turn is all answer: a
    json_schema or a forced call holds from the first token (the grammar let the model open a
    second think block and think until max_tokens, never answering), and `<think>` the model
    writes is answer text, not reasoning."""
    from hibana_core.errors import GrammarError

    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    ask = [{"role": "user", "content": "weather in Paris?"}]
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    for state, body, options in (("off-json", '{"answer": "sunny"}', {"params": SamplingParams(json_schema=schema)}),
                                 ("off-call", call, {"tools": tools, "tool_choice": "required"})):
        n = force(engine, state, f"{body}<|im_end|>")
        options["params"] = SamplingParams(max_tokens=n, json_schema=options["params"].json_schema
                                           if "params" in options else None)
        result = Chat(engine, state).respond(ask, reasoning=False, **options)
        assert result.reasoning in ("", None) and (result.text == body or result.tool_calls)
        n = force(engine, state + "-think", f"<think>\n{THOUGHT}\n</think>\n\n{body}<|im_end|>")
        options["params"] = dataclasses.replace(options["params"], max_tokens=n)
        with pytest.raises(GrammarError):
            Chat(engine, state + "-think").respond(ask, reasoning=False, **options)
    n = force(engine, "off-text", f"<think>{THOUGHT}</think> {ANSWER}<|im_end|>")
    result = Chat(engine, "off-text").respond(ask, params=SamplingParams(max_tokens=n), reasoning=False)
    assert result.text == f"<think>{THOUGHT}</think> {ANSWER}" and not result.reasoning


def test_streamed_thinking_joins_to_the_results_reasoning():
    """However the text is cut into deltas, the thinking streamed joins to the result's (stripped)
    reasoning: the newlines around the think block are not streamed either."""
    from hibana_core.turn import Thinking

    text = "<think>\n\nA thought,  with  spaces.\n\n more \n</think>\n\nAnswer"
    for seed in range(200):
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, 12)))
        thinking, streamed, answer = Thinking(), "", ""
        for piece in (text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])):
            thought, said = thinking.feed(piece)
            streamed, answer = streamed + thought, answer + said
        thought, said = thinking.close()
        assert (streamed + thought, answer + said) == (thinking.text, "Answer") == \
            ("A thought,  with  spaces.\n\n more", "Answer"), cuts


def test_an_observation_quoting_control_text_renders_as_the_template_does(tmp_path, make_engine):
    """A text-protocol agent's observation (a user message in <tool_response> tags) that quotes a
    control token: the whole message was masked as one sentinel, so Qwen3's template no longer saw
    the tags it reads to tell an observation from a query, kept other thinking than the real render,
    and the call failed (PromptMarkupError). Now it renders as the template does, the control text
    as text."""
    engine = make_engine(make_reasoning_checkpoint(tmp_path / "qwen3-observations", OBSERVATION_QUERIES))
    messages = [{"role": "user", "content": "Find the page."},
                {"role": "assistant", "content": "Fetching.", "reasoning_content": "Need to fetch."},
                {"role": "user", "content": "<tool_response>\nthe page quotes <|im_end|> here\n</tool_response>"}]
    rendered = Chat(engine).render_text(messages)
    assert rendered == engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "Need to fetch." in rendered  # the thinking the template keeps before an observation
    end = engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert Chat(engine).render(messages).count(end) == 3  # the turns' own ends, not the quoted one


def test_reasoning_effort_none_switches_thinking_off_in_process_too(engine):
    """`reasoning_effort="none"` switched Qwen3's thinking off through `hibana serve` only: in process
    (Chat, ChatHibana) the template ignored it and thought; a level no model has ("bogus", "HIGH")
    was taken without a word, and "none" beside reasoning=True too."""
    ask = [{"role": "user", "content": "hi"}]
    chat = Chat(engine)
    assert chat.render_text(ask, effort="none") == chat.render_text(ask, reasoning=False)
    assert chat.render_text(ask, effort="none").endswith("<think>\n\n</think>\n\n")
    assert chat.render_text(ask, effort="high") == chat.render_text(ask)  # a level Qwen3's template does not read
    for level in ("bogus", "HIGH", ""):
        with pytest.raises(ConfigError, match="no reasoning_effort level"):
            chat.render_text(ask, effort=level)
    with pytest.raises(ConfigError, match="disagree"):
        chat.render_text(ask, reasoning=True, effort="none")


def test_a_level_beside_reasoning_false_is_refused_in_process_as_the_server_refuses_it(engine):
    """reasoning=False with reasoning_effort="high" asks for no thinking and for thinking at a level:
    a ConfigError, as `hibana serve` answers enable_thinking=false beside an effort with a 400
    (it was taken, the level dropped, the thinking off); "none" beside False agrees."""
    chat = Chat(engine, "disagree")
    ask = [{"role": "user", "content": "hi"}]
    with pytest.raises(ConfigError, match="disagree"):
        chat.render_text(ask, reasoning=False, effort="high")
    with pytest.raises(ConfigError, match="disagree"):
        chat.respond(ask, reasoning=False, reasoning_effort="low")
    assert chat.render_text(ask, reasoning=False, effort="none") == chat.render_text(ask, reasoning=False)


def test_usage_counts_the_thinkings_tokens(engine):
    """usage.reasoning_tokens: the completion's tokens of its think block (OpenAI's
    completion_tokens_details.reasoning_tokens, LangChain's output_token_details["reasoning"]): the
    tokens through the one that closes the block; none for a turn that does not think."""
    messages = [{"role": "user", "content": "hi"}]
    thought = len(engine.tokenizer.encode(f"<think>\n{THOUGHT}\n</think>", add_special_tokens=False))
    n = force(engine, "count", OUTPUT)
    usage = Chat(engine, "count").respond(messages, params=SamplingParams(max_tokens=n)).usage
    assert usage.completion_tokens == n and usage.reasoning_tokens == thought
    n = force(engine, "count-stream", OUTPUT)
    deltas = list(Chat(engine, "count-stream").stream_respond(messages, params=SamplingParams(max_tokens=n)))
    assert deltas[-1].result.usage.reasoning_tokens == thought
    n = force(engine, "count-none", f"{ANSWER}<|im_end|>")
    assert Chat(engine, "count-none").respond(messages, params=SamplingParams(max_tokens=n)).usage.reasoning_tokens == 0


@pytest.mark.parametrize("choice", ["required", "answer"])
def test_the_grammar_ends_the_think_block_where_the_parser_does(engine, choice):
    """The think block ends at its first </think> for the grammar as for `Thinking`: a forced
    call or an answer under a schema follows its blank line, and "</think> free text" is refused
    (the block's end was "</think>\\n\\n": "</think> x" was thinking to the grammar and a free
    answer to the parser, which a sampled reasoning model wrote, its answer no JSON)."""
    from hibana_core import turn

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    inner = (turn.parser_grammar(engine.chat("x").parser, "hermes", tools, "required") if choice == "required"
             else {"type": "structural_tag", "format": {"type": "json_schema", "json_schema": schema}})
    grammar = turn.after_thinking(inner, "required", open_in_prompt=False)

    def takes(text: str) -> bool:
        matcher = engine.grammars.matcher(SamplingParams(grammar=grammar), ())
        return all(matcher.accept(t) for t in engine.tokenizer.encode(text, add_special_tokens=False))

    assert takes("<think>\nHm </think>\n\n")
    assert not takes("<think>\nHm </think> free text")


def test_thinking_off_is_refused_where_the_template_has_no_switch_for_it(tmp_path, make_engine):
    """A template that opens the think block itself and reads no enable_thinking (DeepSeek-R1's):
    reasoning=False changed nothing, the model thought all the same; it is a ConfigError saying the
    template cannot switch it off (Qwen3's switch is test_reasoning_reaches_the_template's)."""
    from reasoning_model import TEMPLATE

    switch = next(line for line in TEMPLATE.splitlines() if "enable_thinking" in line)
    engine = make_engine(make_reasoning_checkpoint(tmp_path / "r1", TEMPLATE.replace(switch, '{{- "<think>\\n" -}}')))
    chat = Chat(engine)
    ask = [{"role": "user", "content": "hi"}]
    assert chat.thinks and chat.render_text(ask).endswith("<|im_start|>assistant\n<think>\n")
    with pytest.raises(ConfigError, match=r"no switch for thinking .*all the same, as it was trained to\. Leave"):
        chat.render_text(ask, reasoning=False)
    assert chat.render_text(ask, reasoning=True) == chat.render_text(ask)


GRANITE_TEMPLATE = (  # Granite 3.2 / 3.3's: thinking asked in the default system prompt only where `thinking` is given
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}"
    "{%- set rest = messages[1:] %}{%- else %}{%- set system = 'You are Granite, developed by IBM.' %}"
    "{%- if thinking %}{%- set system = system + ' Write your thoughts between <think></think> and write your '"
    " + 'response between <response></response> for each user query.' %}"
    "{%- else %}{%- set system = system + ' You are a helpful AI assistant.' %}{%- endif %}"
    "{%- set rest = messages %}{%- endif %}<|im_start|>system\n{{ system }}<|im_end|>\n"
    "{%- for m in rest %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


def test_thinking_off_is_taken_where_the_template_thinks_only_when_asked_otherwise(tmp_path, make_engine):
    """Granite 3.2 / 3.3's template knows think blocks but asks for them only under its own `thinking`
    flag (it reads no enable_thinking): by default the model does not think, so reasoning=False (the
    server's enable_thinking false, which clients send to any model) is what it does anyway, and
    renders as unset; it was a ConfigError saying the model would think all the same."""
    engine = make_engine(make_reasoning_checkpoint(tmp_path / "granite", GRANITE_TEMPLATE))
    chat = Chat(engine)
    ask = [{"role": "user", "content": "hi"}]
    assert chat.thinks and "<think>" not in chat.render_text(ask)
    assert chat.render_text(ask, reasoning=False) == chat.render_text(ask)
    assert chat.render_text(ask, effort="none") == chat.render_text(ask)


def test_thinking_switched_off_by_a_bare_close_holds_the_answer_from_its_first_token(tmp_path, make_engine):
    """A template whose thinking-off prompt ends in a bare </think> (DeepSeek-V3.1's) and that renders
    no reasoning_content says nothing of what it writes between a think block and an answer: a JSON
    answer starts right after the prompt, as the history writes it back (no blank line guessed)."""
    from reasoning_model import TEMPLATE
    from hibana_core.chat import assistant_message

    branch = TEMPLATE[TEMPLATE.index('{%- if loop.index0 > ns.last_query and reasoning -%}'):
                      TEMPLATE.index('{%- for tc in m.tool_calls')]
    template = TEMPLATE.replace(branch, '{{- "<|im_start|>assistant\\n</think>" + content -}}').replace(
        '{{- "<think>\\n\\n</think>\\n\\n" -}}', '{{- "</think>" -}}')
    engine = make_engine(make_reasoning_checkpoint(tmp_path / "v31", template))
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    ask = [{"role": "user", "content": "weather?"}]
    n = force(engine, "v31", '{"answer": "sunny"}<|im_end|>')
    chat = Chat(engine, "v31")
    assert chat.render_text(ask, reasoning=False).endswith("<|im_start|>assistant\n</think>")
    result = chat.respond(ask, params=SamplingParams(max_tokens=n, json_schema=schema), reasoning=False)
    assert result.text == '{"answer": "sunny"}'
    again = chat.respond(ask + [assistant_message(result), {"role": "user", "content": "Thanks."}],
                         params=SamplingParams(max_tokens=2), reasoning=False)
    assert again.usage.cached_tokens >= result.usage.prompt_tokens + result.usage.completion_tokens - 1
