"""The parameter surface of both adapters (issue 16): unknown options and call kwargs raise a
ConfigError naming the accepted ones, values are checked at construction, the peers' aliases
mean what they mean there, and every sampling option reaches the sampler."""

from __future__ import annotations

import json
import warnings

import pytest
from langchain_core.messages import HumanMessage
from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.constants import DEFAULT_NUM_OUTPUTS

from hibana_core import Engine
from hibana_core.errors import ConfigError
from hibana_plugins.langchain import ChatHibana
from hibana_plugins.llamaindex import HibanaLLM

PROMPT = "Tell me about the weather in Paris."


@pytest.fixture(scope="module")
def engine():
    return Engine.shared("demo")


# --- LangChain ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("options, named", [
    ({"temperatur": 0.7}, "did you mean 'temperature'"),
    ({"format": "json"}, "json_mode"),
    ({"logprob": True}, "did you mean 'logprobs'"),
    ({"model_kwargs": {"top_p": 0.5}}, "'model_kwargs'"),
    ({"surgery": ["w8"]}, "an engine option, fixed when the engine loads: give the constructor "
                          "engine_kwargs={'surgery': ...}"),
    ({"kv_dtype": "fp8"}, "engine_kwargs={'kv_dtype': ...}"),
])
def test_chat_hibana_refuses_unknown_options(options, named):
    with pytest.raises(ConfigError, match="accepts .*temperature") as info:
        ChatHibana(**options)
    assert named in str(info.value)


@pytest.mark.parametrize("options, message", [
    ({"temperature": -1}, "temperature must be >= 0"),
    ({"top_p": 0}, "top_p"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"min_p": 2}, "min_p"),
    ({"repeat_penalty": 0}, "repetition_penalty"),
    ({"temperature": "hot"}, "temperature"),
    ({"num_predict": 3, "max_tokens": 4}, "name the same option"),
    ({"speculation": {"method": "nope"}}, r"no drafter named 'nope' is registered \(registered: .*suffix"),
    ({"speculation": {"method": "suffix", "k": 99}}, "speculation k must lie in"),
    ({"speculation": 1}, r"speculation must be 'adaptive' \(or True\), 'off' \(or False\).*got 1"),
    ({"speculation": 0}, r"speculation must be .*got 0"),
    ({"max_tokens": 0}, "max_tokens must be at least 1"),
    ({"num_predict": -1}, "max_tokens must be >= 0"),
    ({"state_id": ""}, "ChatHibana: state ids are non-empty strings"),  # (it failed only on the first call)
    ({"state_id": "a\ud800"}, "ChatHibana: state id .* holds a lone surrogate"),
    # engine options too, as HibanaLLM checks them (they failed only once the first call loaded the engine)
    ({"num_ctx": "x"}, "max_model_len must be a 64-bit integer"),
    ({"engine_kwargs": {"bogus": 1}}, "unknown engine option 'bogus'"),
    ({"engine_kwargs": {"max_model_len": -5}}, "max_model_len must be positive"),
    ({"reasoning": "yes"}, "(?s)reasoning.*must be True or False, got 'yes'"),  # pydantic read "yes" as True
    ({"logprobs": 1}, "(?s)logprobs.*must be True or False, got 1"),
    # as given, before pydantic reads True as 1 and "5" as 5 (max_tokens=True gave one-token replies)
    ({"max_tokens": True}, "max_tokens must be a 64-bit integer, got True"),
    ({"max_tokens": "5"}, "max_tokens must be a 64-bit integer"),
    ({"seed": True}, "seed"),
    ({"temperature": "0.5"}, "temperature"),
    ({"top_k": 2.0}, "top_k"),
    ({"reasoning": True, "reasoning_effort": "none"}, "reasoning_effort 'none' and reasoning=True disagree"),
    ({"reasoning_effort": 3}, "reasoning_effort must be a level"),
])
def test_chat_hibana_checks_values_at_construction(options, message):
    with pytest.raises(ConfigError, match=message):
        ChatHibana(**options)


def test_chat_hibana_takes_a_checkpoint_path_as_the_engine_does(tmp_path):
    """A pathlib.Path is a model as it is for Engine.from_pretrained (and HibanaLLM); it was a
    ConfigError "Input should be a valid string"."""
    assert ChatHibana(model=tmp_path / "checkpoint").model == str(tmp_path / "checkpoint")


def test_chat_hibana_round_trips_through_langchains_dumps_and_loads(engine, tmp_path):
    """LangChain's serialisation (`dumps` / `loads`, as ChatOpenAI's): the options it was made
    with, never its engine (the loaded object finds Engine.shared(model, ...) on first use, as an
    unpickled one does); it was written as "not_implemented", which `loads` refuses. A checkpoint
    path is written as its text. The class says it is not serialisable (is_lc_serializable), so
    that langchain-tests' test_serdes, whose load admits LangChain's own mapped classes only,
    skips it as it did."""
    from langchain_core.load import dumpd, dumps, loads

    llm = ChatHibana(engine=engine, temperature=0.5, max_tokens=17, stop="END", seed=3, state_id="saved",
                     speculation={"method": "suffix", "k": 3}, reasoning=False, logprobs=True, top_logprobs=2)
    text = dumps(llm)
    kwargs = json.loads(text)["kwargs"]
    assert json.loads(text)["id"] == ["hibana_plugins", "langchain", "ChatHibana"]
    assert {k: kwargs[k] for k in ("model", "temperature", "max_tokens", "stop", "seed", "state_id", "speculation",
                                   "reasoning", "logprobs", "top_logprobs")} == {
        "model": "demo", "temperature": 0.5, "max_tokens": 17, "stop": ["END"], "seed": 3, "state_id": "saved",
        "speculation": {"method": "suffix", "k": 3}, "reasoning": False, "logprobs": True, "top_logprobs": 2}
    assert "given_engine" not in kwargs and "engine" not in kwargs
    assert not ChatHibana.is_lc_serializable()
    back = loads(text, allowed_objects=[ChatHibana], valid_namespaces=["hibana_plugins"])
    assert type(back) is ChatHibana and back.model_dump() == llm.model_dump()
    assert back.engine is engine  # Engine.shared("demo")
    with pytest.raises(ValueError, match="Invalid namespace"):  # LangChain's rule for packages of its own
        loads(text, allowed_objects=[ChatHibana])

    by_path = ChatHibana(model=tmp_path / "checkpoint", engine_kwargs={"state_dir": tmp_path / "states"})
    assert dumpd(by_path)["kwargs"]["engine_kwargs"] == {"state_dir": str(tmp_path / "states")}
    assert by_path.engine_kwargs == {"state_dir": tmp_path / "states"}  # the object's own left as it was
    back = loads(dumps(by_path), allowed_objects=[ChatHibana], valid_namespaces=["hibana_plugins"])
    assert (back.model, back.engine_kwargs) == (str(tmp_path / "checkpoint"), {"state_dir": str(tmp_path / "states")})


def test_chat_hibana_with_an_option_json_cannot_hold_still_runs_and_loads_say_which():
    """An engine option given as an object (a CacheConfig whole) has no JSON form: LangChain writes
    its marker there (and writes this form for callbacks on every call, which must not fail), and
    `loads` refuses it naming the value. The cache key is not the serialised form: objects on two
    engines of one model, or with the same stop strings given on the object or the call, were
    keyed apart or together by it, not by what changes a reply."""
    from langchain_core.load import dumps, loads

    from hibana_core.config import CacheConfig

    llm = ChatHibana(model="demo", engine_kwargs={"cache": CacheConfig(block_size=32)})
    text = dumps(llm)
    with pytest.raises(NotImplementedError, match="CacheConfig"):
        loads(text, allowed_objects=[ChatHibana], valid_namespaces=["hibana_plugins"])
    assert llm._get_llm_string() != ChatHibana(model="demo")._get_llm_string()
    assert ChatHibana(stop=["x"])._get_llm_string() == ChatHibana()._get_llm_string(stop=["x"])


def test_chat_hibana_aliases_and_ignored_options():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        llm = ChatHibana(num_ctx=1024, num_predict=7, repeat_penalty=1.1, keep_alive="5m")
    assert llm.engine_kwargs == {"max_model_len": 1024}
    assert (llm.max_tokens, llm.repetition_penalty) == (7, 1.1)
    assert any("keep_alive" in str(w.message) for w in caught)


def test_chat_hibana_refuses_unknown_call_kwargs(engine):
    llm = ChatHibana(engine=engine, max_tokens=4)
    with pytest.raises(ConfigError, match="does not take 'logprob' .*did you mean 'logprobs'"):
        llm.bind(logprob=True)
    with pytest.raises(ConfigError, match="top_logprobs needs logprobs"):
        llm.invoke(PROMPT, top_logprobs=2)
    with pytest.raises(ConfigError, match="does not take 'foo'.*accepts"):
        llm.invoke(PROMPT, foo=1)
    with pytest.raises(ConfigError, match="does not take 'max_model_len' .max_model_len is what num_ctx"):
        llm.invoke(PROMPT, num_ctx=512)  # the alias the caller wrote is named, not only its meaning
    with pytest.raises(ConfigError, match="temperature"):
        llm.invoke(PROMPT, temperature=-0.5)
    with pytest.raises(ConfigError, match="max_tokens must be at least 1"):  # as the server and HibanaLLM
        llm.invoke(PROMPT, max_tokens=0)
    # LangChain's own per-call switch: `invoke(..., stream=...)` picks _stream or _generate (it was refused)
    assert llm.invoke(PROMPT, stream=True).content == llm.invoke(PROMPT, stream=False).content


def test_chat_hibana_call_options_reach_the_sampler(engine):
    llm = ChatHibana(engine=engine, max_tokens=12)
    assert llm.invoke(PROMPT, num_predict=3).usage_metadata["output_tokens"] == 3
    assert llm.bind(max_tokens=2).invoke(PROMPT).usage_metadata["output_tokens"] == 2
    full = llm.invoke(PROMPT).content
    word = full.split()[1]
    assert word not in llm.invoke(PROMPT, stop=[word]).content
    sampled = ChatHibana(engine=engine, max_tokens=12, temperature=1.5, seed=7, min_p=0.05, top_k=40)
    first = sampled.invoke([HumanMessage(PROMPT)]).content
    assert sampled.invoke([HumanMessage(PROMPT)]).content == first            # seeded: repeatable
    others = {sampled.invoke(PROMPT, seed=s).content for s in range(8, 12)}
    assert others - {first}                                                  # the call's seed is used
    penalised = ChatHibana(engine=engine, max_tokens=24, frequency_penalty=2.0, presence_penalty=2.0).invoke(PROMPT)
    assert penalised.content != ChatHibana(engine=engine, max_tokens=24).invoke(PROMPT).content


def _first_token(engine, text: str) -> int:
    return engine.tokenizer.encode(text, add_special_tokens=False)[0]


def test_chat_hibana_logit_bias_on_the_object_and_per_call(engine):
    """OpenAI's logit_bias (as ChatOpenAI takes it): the greedy reply's first token banned, the
    reply starts otherwise; the same per call; a bias out of range is a ConfigError at once."""
    llm = ChatHibana(engine=engine, max_tokens=8)
    plain = llm.invoke(PROMPT).content
    ban = {_first_token(engine, plain): -100}
    biased = ChatHibana(engine=engine, max_tokens=8, logit_bias=ban).invoke(PROMPT).content
    assert biased and _first_token(engine, biased) not in ban
    assert llm.invoke(PROMPT, logit_bias=ban).content == biased
    assert llm.invoke(PROMPT).content == plain  # the call's bias is the call's alone
    with pytest.raises(ConfigError, match="logit_bias"):
        ChatHibana(logit_bias={1: 500})


def test_hibana_llm_logit_bias(engine):
    llm = HibanaLLM(engine=engine, max_tokens=8)
    plain = llm.complete(PROMPT).text
    ban = {_first_token(engine, plain.lstrip()): -100}
    biased = HibanaLLM(engine=engine, max_tokens=8, logit_bias=ban).complete(PROMPT).text
    assert biased != plain
    assert llm.complete(PROMPT, logit_bias=ban).text == biased


# --- LlamaIndex --------------------------------------------------------------------------------------

def test_hibana_llm_refuses_unknown_options_before_loading():
    with pytest.raises(ConfigError, match="'temperatur' .*did you mean 'temperature'.*accepts"):
        HibanaLLM(model="/nonexistent", temperatur=0.7)
    with pytest.raises(ConfigError, match=r"'surgery' \(an engine option, .*engine_kwargs=\{'surgery': \.\.\.\}"):
        HibanaLLM(model="/nonexistent", surgery=["w8"])
    with pytest.raises(ConfigError, match="temperature must be >= 0"):
        HibanaLLM(model="/nonexistent", temperature=-1)
    with pytest.raises(ConfigError, match="repetition_penalty"):
        HibanaLLM(model="/nonexistent", repeat_penalty=-1.0)
    with pytest.raises(ConfigError, match="HibanaLLM: no drafter named 'draft' is registered"):
        HibanaLLM(model="/nonexistent", speculation={"method": "draft", "k": 2})


def test_hibana_llm_aliases_and_options(engine):
    llm = HibanaLLM(engine=engine, num_predict=5, repeat_penalty=1.2, stop=["zzz"], min_p=0.1, presence_penalty=0.5)
    assert (llm.max_tokens, llm.repetition_penalty, llm.stop, llm.min_p) == (5, 1.2, ["zzz"], 0.1)
    assert llm.complete(PROMPT).raw["usage"]["completion_tokens"] == 5
    msgs = [ChatMessage(role="user", content=PROMPT)]
    assert llm.chat(msgs, max_tokens=2).raw["usage"]["completion_tokens"] == 2
    with pytest.raises(ConfigError, match="HibanaLLM.chat does not take 'foo'"):
        llm.chat(msgs, foo=1)
    with pytest.raises(ConfigError, match="HibanaLLM.complete does not take 'tools'"):
        llm.complete(PROMPT, tools=[])


def test_hibana_llm_stop_and_seed(engine):
    llm = HibanaLLM(engine=engine, max_tokens=12)
    full = llm.complete(PROMPT).text
    word = full.split()[1]
    assert word not in HibanaLLM(engine=engine, max_tokens=12, stop=[word]).complete(PROMPT).text
    sampled = HibanaLLM(engine=engine, max_tokens=12, temperature=1.5, seed=3)
    assert sampled.complete(PROMPT).text == sampled.complete(PROMPT).text


# --- logprobs ----------------------------------------------------------------------------------------

def _check_openai_logprobs(content: list[dict], top: int) -> None:
    assert content and all(e["logprob"] <= 0.0 and len(e["top_logprobs"]) == top for e in content)
    for e in content:  # greedy: the chosen token is the most likely one
        assert e["top_logprobs"][0]["token"] == e["token"] if top else True
        assert e["bytes"] == list(e["token"].encode())


def test_chat_hibana_logprobs(engine):
    llm = ChatHibana(engine=engine, max_tokens=8)
    plain = llm.invoke(PROMPT)
    assert "logprobs" not in plain.response_metadata
    message = llm.bind(logprobs=True, top_logprobs=2).invoke(PROMPT)
    assert message.content == plain.content                                 # greedy output unchanged
    content = message.response_metadata["logprobs"]["content"]
    assert len(content) == message.usage_metadata["output_tokens"]
    _check_openai_logprobs(content, 2)
    assert "".join(e["token"] for e in content).strip().startswith(plain.content[:10])
    streamed, carried = None, []
    for chunk in ChatHibana(engine=engine, max_tokens=8, logprobs=True).stream(PROMPT):
        streamed = chunk if streamed is None else streamed + chunk
        if chunk.content:  # a chunk of text carries its own tokens' log-probabilities, as ChatOpenAI's
            carried.append(chunk.response_metadata["logprobs"]["content"])
            assert "".join(e["token"] for e in carried[-1]) == chunk.content
    assert len(carried) > 1
    assert streamed.content == plain.content                                 # as streamed, whole
    assert [e["logprob"] for e in streamed.response_metadata["logprobs"]["content"]] == \
        pytest.approx([e["logprob"] for e in content], abs=1e-5)


def test_hibana_llm_logprobs(engine):
    llm = HibanaLLM(engine=engine, max_tokens=8)
    msgs = [ChatMessage(role="user", content=PROMPT)]
    plain = llm.chat(msgs)
    assert plain.logprobs is None
    response = HibanaLLM(engine=engine, max_tokens=8, logprobs=True, top_logprobs=3).chat(msgs)
    assert response.message.content == plain.message.content
    assert len(response.logprobs) == response.raw["usage"]["completion_tokens"]
    assert all(len(position) == 4 and position[0].token == position[1].token and position[0].logprob <= 0
               for position in response.logprobs)
    completion = llm.complete(PROMPT, logprobs=True)
    assert len(completion.logprobs) == completion.raw["usage"]["completion_tokens"]


# --- token counting ----------------------------------------------------------------------------------

def test_chat_hibana_counts_with_the_models_tokenizer(engine, monkeypatch):
    import langchain_core.language_models.base as base
    from langchain_core.messages import AIMessage, SystemMessage, ToolMessage, trim_messages
    from langchain_core.tools import tool

    monkeypatch.setattr(base, "get_tokenizer", lambda: pytest.fail("GPT-2's tokenizer was asked for"))

    @tool
    def get_weather(city: str) -> str:
        """Weather of a city."""
        return "sunny"

    llm = ChatHibana(engine=engine)
    text = "Weather in Paris?"
    assert llm.get_token_ids(text) == engine.tokenizer.encode(text, add_special_tokens=False)
    assert llm.get_num_tokens(text) == len(llm.get_token_ids(text))
    messages = [SystemMessage("You are helpful."), HumanMessage(text)]
    rendered = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(
        [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": text}],
        add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    assert llm.get_num_tokens_from_messages(messages) == len(rendered)
    # as invoke takes them: ("role", "text") tuples and OpenAI-style dicts count the same
    assert llm.get_num_tokens_from_messages([("system", "You are helpful."), ("user", text)]) == len(rendered)
    assert llm.get_num_tokens_from_messages([{"role": "system", "content": "You are helpful."},
                                             {"role": "user", "content": text}]) == len(rendered)
    with_tools = llm.get_num_tokens_from_messages(messages, tools=[get_weather])
    assert with_tools > len(rendered) + llm.get_num_tokens("get_weather")
    # the count is what a call reports as its prompt
    reply = llm.bind_tools([get_weather]).invoke(messages, max_tokens=2)
    assert reply.usage_metadata["input_tokens"] == with_tools
    # parts of a conversation the template refuses still count, and trim_messages works
    orphan = [ToolMessage("sunny", tool_call_id="c1"), AIMessage("It is sunny.")]
    assert llm.get_num_tokens_from_messages(orphan) >= llm.get_num_tokens("sunnyIt is sunny.")
    # a call whose arguments JSON cannot hold (a date: invoke refuses it, a ConversationError) counts
    # too, as its text (it raised TypeError)
    import datetime

    call = {"name": "get_weather", "args": {"on": datetime.date(2024, 5, 1)}, "id": "c1"}
    dated = [HumanMessage(text), AIMessage("", tool_calls=[call]), ToolMessage("sunny", tool_call_id="c1")]
    assert llm.get_num_tokens_from_messages(dated) >= llm.get_num_tokens("2024-05-01sunny")
    long = [SystemMessage("You are helpful.")] + [HumanMessage(f"question {i} " * 20) for i in range(30)]
    kept = trim_messages(long, max_tokens=200, token_counter=llm, strategy="last", include_system=True)
    assert 1 < len(kept) < len(long) and llm.get_num_tokens_from_messages(kept) <= 200


def test_hibana_llm_metadata_from_the_model(engine):
    meta = HibanaLLM(engine=engine, max_tokens=77).metadata
    assert meta.context_window == engine.max_model_len and meta.num_output == 77
    assert meta.model_name == str(engine.config.model)


def test_max_tokens_none_generates_up_to_the_context():
    """max_tokens=None as the frameworks' own examples write it (`ChatOpenAI(..., max_tokens=None,
    timeout=None, max_retries=2)`): no limit but the model's context, in both adapters."""
    engine = Engine.shared("demo", max_model_len=64)
    llm = ChatHibana(engine=engine, temperature=0, max_tokens=None, timeout=None, max_retries=2)
    reply = llm.invoke("What is the weather in Paris?")
    assert reply.response_metadata["finish_reason"] == "length"
    assert reply.usage_metadata["total_tokens"] == 64
    assert llm.invoke("What is the weather in Paris?", max_tokens=3).usage_metadata["output_tokens"] == 3
    index_llm = HibanaLLM(engine=engine, max_tokens=None)
    usage = index_llm.complete("What is the weather in Paris?").raw["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 64
    assert index_llm.metadata.num_output == DEFAULT_NUM_OUTPUTS  # what LlamaIndex reserves when it is not told


def test_hibana_llm_takes_ollamas_example_options(engine):
    """`Ollama(model=..., request_timeout=120.0, context_window=8000)`, LlamaIndex's own local-model
    example, becomes HibanaLLM unchanged: a per-call timeout and the engine's context."""
    from hibana_core.errors import ChatTimeoutError

    llm = HibanaLLM(model="demo", max_tokens=4, request_timeout=120.0, context_window=1024)
    assert (llm.timeout, llm.engine_kwargs) == (120.0, {"max_model_len": 1024})
    assert llm.engine.max_model_len == 1024 and llm.metadata.context_window == 1024
    msgs = [ChatMessage(role="user", content=PROMPT)]
    assert llm.chat(msgs).raw["usage"]["completion_tokens"] == 4
    with pytest.raises(ChatTimeoutError):
        llm.chat(msgs, timeout=1e-9)
    with pytest.raises(ChatTimeoutError):
        HibanaLLM(engine=engine, timeout=1e-9).complete(PROMPT)
    with pytest.raises(ConfigError, match="timeout"):
        HibanaLLM(engine=engine, timeout=-1)


def test_the_context_per_call_is_refused_with_where_to_set_it(engine):
    """num_ctx / context_window are the engine's context: a call giving one is told to set it on
    the constructor (not offered max_tokens as a close match)."""
    with pytest.raises(ConfigError, match="constructor") as info:
        ChatHibana(engine=engine, max_tokens=2).invoke(PROMPT, num_ctx=512)
    assert "did you mean" not in str(info.value)
    with pytest.raises(ConfigError, match="constructor"):
        HibanaLLM(engine=engine, max_tokens=2).chat([ChatMessage(role="user", content=PROMPT)], context_window=512)


def test_engine_options_beside_a_given_engine_are_refused_unless_it_has_them(engine):
    """ChatHibana(engine=e, context_window=512) ran on e's own context: the option was dropped
    without a word. Options the engine was loaded with pass; others are a ConfigError saying how
    to load the engine with them."""
    for make in (ChatHibana, HibanaLLM):
        with pytest.raises(ConfigError, match=r"context_window|max_model_len") as info:
            make(engine=engine, context_window=512)
        assert "Engine.from_pretrained(..., max_model_len=...)" in str(info.value)
        with pytest.raises(ConfigError, match="block_size"):
            make(engine=engine, engine_kwargs={"block_size": engine.config.cache.block_size * 2})
        same = {"block_size": engine.config.cache.block_size}
        assert make(engine=engine, engine_kwargs=same).engine is engine
        kv = str(engine.kv_cache.dtype).removeprefix("torch.")  # what kv_dtype "auto" resolved to
        assert make(engine=engine, engine_kwargs={"kv_dtype": kv}).engine is engine
        with pytest.raises(ConfigError, match="kv_dtype"):
            make(engine=engine, engine_kwargs={"kv_dtype": "fp8"})
        # what the engine resolved passes: the model's own context (LlamaIndex's context_window,
        # Ollama's num_ctx), the device and dtype "auto" chose; these were refused
        assert engine.config.max_model_len is None and engine.config.dtype == "auto"
        assert make(engine=engine, context_window=engine.max_model_len).engine is engine
        assert make(engine=engine, num_ctx=engine.max_model_len).engine is engine
        resolved = {"device": str(engine.device), "dtype": str(engine.dtype).removeprefix("torch.")}
        assert make(engine=engine, engine_kwargs=resolved).engine is engine


def test_chat_openais_stream_usage_is_accepted_as_always_on(engine):
    """`ChatOpenAI(..., stream_usage=True)` swapped for ChatHibana runs: usage always comes on a
    stream's last chunk, so the option is dropped with a warning that says so."""
    with pytest.warns(UserWarning, match="stream_usage.*last chunk"):
        llm = ChatHibana(engine=engine, max_tokens=3, stream_usage=True)
    chunks = list(llm.stream(PROMPT))
    assert sum(chunks[1:], chunks[0]).usage_metadata["output_tokens"] == 3


def test_hibana_llm_refuses_prompt_formatters_it_would_not_use(engine):
    """LlamaIndex's messages_to_prompt / completion_to_prompt (HuggingFaceLLM's) would be ignored:
    HibanaLLM renders with the model's chat template. Given, they are a ConfigError that says so."""
    for option in ("messages_to_prompt", "completion_to_prompt"):
        with pytest.raises(ConfigError, match=f"{option}.*chat template"):
            HibanaLLM(engine=engine, **{option: str})
    assert HibanaLLM(engine=engine, messages_to_prompt=None, completion_to_prompt=None).max_tokens == 256


@pytest.mark.parametrize("options, message", [
    ({"reasoning": "yes"}, "reasoning must be True or False, got 'yes'"),  # read as True, as "no" and 0 as False
    ({"reasoning": 0}, "reasoning must be True or False, got 0"),
    ({"clean_tool_schemas": "false"}, "clean_tool_schemas must be True or False"),
    ({"reasoning": True, "reasoning_effort": "none"}, "reasoning_effort 'none' and reasoning=True disagree"),
])
def test_hibana_llm_checks_switches_at_construction(options, message, engine):
    with pytest.raises(ConfigError, match=message):
        HibanaLLM(engine=engine, **options)


@pytest.mark.parametrize("state_id", ["", "a\ud800"])
def test_hibana_llm_checks_its_state_id_at_construction(state_id, engine):
    """(an empty one failed only on the first call)"""
    with pytest.raises(ConfigError, match="HibanaLLM: state id"):
        HibanaLLM(engine=engine, state_id=state_id)


def test_an_object_on_a_shared_engine_closed_meanwhile_finds_the_new_one(monkeypatch):
    """`llm.engine.close()` on a shared engine: a new ChatHibana or HibanaLLM found a new engine, the
    object in use kept the closed one, and each of its calls said to create one with
    Engine.from_pretrained. It finds the new one too; an engine passed and closed stays its own."""
    import hibana_core
    from types import SimpleNamespace

    from hibana_plugins.options import EngineChoice, choose_engine

    def fake(closed: bool):
        return SimpleNamespace(core=SimpleNamespace(closed=closed))

    fresh = fake(False)
    monkeypatch.setattr(hibana_core.Engine, "shared", classmethod(lambda cls, model, **kwargs: fresh))
    shared = EngineChoice(fake(True), "demo", {})
    assert choose_engine("demo", {}, shared, None).engine is fresh
    given = EngineChoice(fake(True), "demo", {})
    assert choose_engine("demo", {}, given, given) is given
    open_shared = EngineChoice(fake(False), "demo", {})
    assert choose_engine("demo", {}, open_shared, None) is open_shared


def test_an_fp8_kv_engine_takes_either_name_of_its_kv_dtype():
    """kv_dtype "fp8" and "float8_e4m3fn" name one cache: beside an engine loaded with one, the
    other passes (it was refused as another option, the engine told to load with what it had)."""
    with Engine.from_pretrained("demo", kv_dtype="fp8", surgery_guard=False, progress=False) as engine:
        for name in ("fp8", "float8_e4m3fn"):
            assert ChatHibana(engine=engine, engine_kwargs={"kv_dtype": name}).engine is engine
            assert HibanaLLM(engine=engine, engine_kwargs={"kv_dtype": name}).engine is engine
        with pytest.raises(ConfigError, match="kv_dtype"):
            ChatHibana(engine=engine, engine_kwargs={"kv_dtype": "float32"})
