"""ChatHibana's token counting against the prompt a call reports: `get_num_tokens_from_messages`
is what `trim_messages(..., token_counter=llm)` keeps a conversation inside the context by, so it
must be `usage_metadata["input_tokens"]` of the same call, whatever the object's options."""

from __future__ import annotations

from typing import List

import pytest
from langchain_core.messages import HumanMessage
from pydantic import BaseModel

import tiny_models
from hibana_core import Engine
from hibana_plugins.langchain import ChatHibana
from reasoning_model import make_reasoning_checkpoint


class Node(BaseModel):
    """A tree node."""

    name: str
    children: List["Node"] = []


@pytest.fixture(scope="module")
def reasoning_engine(tmp_path_factory):
    engine = tiny_models.open_engine(make_reasoning_checkpoint(tmp_path_factory.mktemp("reasoning") / "m"))
    yield engine
    engine.close()


@pytest.mark.parametrize("options", [{}, {"reasoning": False}, {"reasoning_effort": "none"}])
def test_the_count_renders_the_objects_reasoning_options(reasoning_engine, options):
    # reasoning_effort "none" switches thinking off, and Qwen3's template then writes an empty think
    # block into the generation prompt: the count left it out (17 tokens, the call 23)
    llm = ChatHibana(engine=reasoning_engine, max_tokens=1, **options)
    messages = [HumanMessage("hi")]
    assert llm.get_num_tokens_from_messages(messages) == llm.invoke(messages).usage_metadata["input_tokens"]


def test_the_count_of_a_tool_that_holds_itself_is_of_its_bound_schema():
    # bind_tools binds such a model's own schema (LangChain's conversion writes {} where it recurs);
    # the count used the conversion's (182 tokens against the call's 258 on the demo model)
    llm = ChatHibana(engine=Engine.shared("demo"), max_tokens=1)
    messages = [HumanMessage("Make a tree.")]
    reply = llm.bind_tools([Node]).invoke(messages)
    assert llm.get_num_tokens_from_messages(messages, tools=[Node]) == reply.usage_metadata["input_tokens"]
