"""ChatHibana's `response_format` call option (ChatOpenAI's) and its LangChain `profile`.

LangChain's `create_agent(response_format=ProviderStrategy(...))` binds the schema as
`bind_tools(tools, response_format={"type": "json_schema", ...})`: the answer's text is held to
the schema by the grammar while the tools stay callable. The profile tells LangChain what the
model does (tools, tool_choice, streamed calls, the context where known) and leaves native
structured output unsaid, so a plain `response_format=Schema` forces an answer tool (ToolStrategy).
"""

from __future__ import annotations

import json
from typing import Annotated

import jsonschema
import pytest

pytest.importorskip("langchain_core")

from langchain_core.messages import HumanMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402
from typing_extensions import TypedDict  # noqa: E402

from hibana_core import Engine  # noqa: E402
from hibana_core.errors import ConfigError, HibanaError  # noqa: E402
from hibana_core.messages import response_format_schema  # noqa: E402
from hibana_plugins.langchain import ChatHibana  # noqa: E402


@tool
def get_weather(city: Annotated[str, "Name of the city."]) -> str:
    """Get the current weather for a city."""
    return json.dumps({"city": city, "temperature": 21, "conditions": "sunny"})


class Forecast(BaseModel):
    """A forecast."""

    city: str = Field(max_length=16)
    sunny: bool
    days: int = Field(ge=1, le=7)


class Pair(TypedDict):
    a: int
    b: list[str]


SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "warm": {"type": "boolean"}},
          "required": ["city", "warm"], "additionalProperties": False}
WRAPPED = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
ASK = [HumanMessage("What's the weather in Oslo?")]


@pytest.fixture(scope="module")
def llm():
    return ChatHibana(model="demo", max_tokens=48)


def test_the_forms_of_response_format():
    """OpenAI's three forms, a pydantic class, a TypedDict and a bare JSON schema (untitled too)."""
    from hibana_plugins.langchain import _response_format

    assert _response_format({"type": "text"}) == (None, False)
    assert _response_format({"type": "json_object"}) == ({"type": "object"}, False)
    assert _response_format(WRAPPED) == (SCHEMA, True)
    assert _response_format(SCHEMA) == (SCHEMA, False)
    schema, strict = _response_format(Forecast)
    assert set(schema["properties"]) == {"city", "sunny", "days"} and schema["properties"]["city"]["maxLength"] == 16
    assert strict is False
    schema, _ = _response_format(Pair)
    assert schema["properties"]["b"] == {"type": "array", "items": {"type": "string"}}


@pytest.mark.parametrize("bad, says", [
    ("json", "response_format must be"),
    (3, "response_format must be"),
    ({"type": "json_schema"}, "response_format.json_schema must be an object"),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA, "strict": "yes"}}, "strict must be a boolean"),
    ({"type": "json_schema", "json_schema": {"schema": []}}, "schema must be a JSON schema object"),
])
def test_a_bad_response_format_is_refused_at_bind(llm, bad, says):
    with pytest.raises(ConfigError, match=says):
        llm.bind(response_format=bad)
    with pytest.raises(ConfigError, match=says):
        llm.invoke(ASK, response_format=bad)


def test_the_server_and_the_adapter_read_response_format_alike():
    """One reading (`messages.response_format_schema`): the server's 400 names the field."""
    from hibana_plugins.openai_api import ApiError, response_schema

    assert response_schema(WRAPPED) == response_format_schema(WRAPPED) == (SCHEMA, True)
    with pytest.raises(ApiError) as error:
        response_schema({"type": "json_schema", "json_schema": {"strict": 1}})
    assert error.value.status == 400 and error.value.param == "response_format.json_schema.strict"
    with pytest.raises(ApiError) as error:
        response_schema({"type": "yaml"})
    assert error.value.param == "response_format.type"


@pytest.mark.parametrize("form", [WRAPPED, SCHEMA])
def test_response_format_holds_the_answer_to_its_schema(llm, form):
    """With no tools, the demo's answer is JSON that validates (sync, and streamed alike)."""
    reply = llm.invoke([HumanMessage("Tell me about the weather in Oslo as JSON.")], response_format=form)
    answer = json.loads(reply.content)
    jsonschema.validate(answer, SCHEMA)
    streamed = "".join(chunk.content for chunk in llm.stream(
        [HumanMessage("Tell me about the weather in Oslo as JSON.")], response_format=form))
    jsonschema.validate(json.loads(streamed), SCHEMA)
    # json_object: any object (the demo's runs on to max_tokens, so only its start is read here)
    anything = llm.invoke([HumanMessage("Tell me about the weather in Oslo as JSON.")],
                          response_format={"type": "json_object"})
    assert anything.content.startswith("{") and anything.response_metadata["finish_reason"] in ("stop", "length")


def test_tools_stay_callable_beside_response_format(llm):
    """As OpenAI's: the schema holds the text answer, not the calls (greedy: the same call as without)."""
    plain = llm.bind_tools([get_weather]).invoke(ASK)
    held = llm.bind_tools([get_weather], response_format=WRAPPED).invoke(ASK)
    assert plain.tool_calls and [c["args"] for c in held.tool_calls] == [c["args"] for c in plain.tool_calls]
    assert held.tool_calls[0]["name"] == "get_weather"


def test_response_format_and_structured_output_are_one_or_the_other(llm):
    with pytest.raises(ConfigError, match="use one"):
        llm.with_structured_output(Forecast, method="json_schema").first.invoke(ASK, response_format=WRAPPED)


def test_the_profile_says_what_the_model_does(llm):
    profile = llm.profile
    assert profile["tool_calling"] and profile["tool_choice"] and profile["tool_call_streaming"]
    assert profile["text_inputs"] and not profile["image_inputs"]
    assert "structured_output" not in profile  # create_agent forces an answer tool (ToolStrategy)
    assert "max_input_tokens" not in profile  # not known before the engine loads
    assert ChatHibana(model="demo", max_model_len=1024).profile["max_input_tokens"] == 1024
    given = ChatHibana(engine=llm.engine)
    assert given.profile["max_input_tokens"] == llm.engine.max_model_len
    mine = ChatHibana(model="demo", profile={"max_input_tokens": 99})
    assert mine.profile == {"max_input_tokens": 99}


def test_create_agent_with_a_response_format():
    """langchain's create_agent: ToolStrategy by default (the answer tool, grammar-held), and
    ProviderStrategy asked for explicitly binds response_format, which the grammar holds."""
    agents = pytest.importorskip("langchain.agents")
    from langchain.agents.structured_output import ProviderStrategy

    llm = ChatHibana(model="demo", max_tokens=48)
    agent = agents.create_agent(llm, [get_weather], response_format=Forecast)
    out = agent.invoke({"messages": [{"role": "user", "content": "What's the weather in Oslo?"}]})
    assert isinstance(out["structured_response"], Forecast)
    assert any(getattr(m, "tool_calls", None) and m.tool_calls[0]["name"] == "get_weather" for m in out["messages"])

    bound = []

    class Recording(ChatHibana):
        def bind_tools(self, tools, **kwargs):
            bound.append(kwargs)
            return super().bind_tools(tools, **kwargs)

    native = agents.create_agent(Recording(engine=llm.engine, max_tokens=48), [],
                                 response_format=ProviderStrategy(Forecast))
    out = native.invoke({"messages": [{"role": "user", "content": "Give me a forecast for Oslo."}]})
    assert bound and bound[0]["response_format"]["type"] == "json_schema"
    assert isinstance(out["structured_response"], Forecast)


def test_response_format_on_a_given_engine_keeps_other_agents_served(llm):
    """A refused response_format fails that call only."""
    engine = llm.engine
    assert isinstance(engine, Engine)
    with pytest.raises(HibanaError):
        llm.invoke(ASK, response_format={"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}})
    assert llm.bind_tools([get_weather]).invoke(ASK).tool_calls
