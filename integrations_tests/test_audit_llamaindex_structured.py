"""Audit of HibanaLLM's structured output as a LlamaIndex user reaches it: every program
LlamaIndex picks gets an answer held to the output class's schema."""

from __future__ import annotations

import pytest
from llama_index.core.prompts import PromptTemplate
from pydantic import BaseModel

from hibana_core import Engine
from hibana_plugins.llamaindex import HibanaLLM


class Point(BaseModel):
    x: int
    y: int


PROMPT = PromptTemplate("Give the point {q}")


@pytest.fixture(scope="module")
def engine():
    with Engine.from_pretrained("demo", device="cpu", progress=False) as engine:
        yield engine


async def test_pydantic_program_mode_llm_holds_the_text_answer_to_the_schema(engine):
    """pydantic_program_mode="llm" (LLMTextCompletionProgram: the schema in the prompt, the answer
    parsed from the text) is held by the grammar as the no-tools template's path is; the demo
    model, asked freely, wrote prose and every entry point raised 'Could not extract json string'
    (the stream ended on an object of empty fields)."""
    llm = HibanaLLM(engine=engine, max_tokens=64, pydantic_program_mode="llm")
    assert isinstance(llm.structured_predict(Point, PROMPT, q="1 2"), Point)
    assert isinstance(list(llm.stream_structured_predict(Point, PROMPT, q="1 2"))[-1], Point)
    assert isinstance(await llm.astructured_predict(Point, PROMPT, q="1 2"), Point)
    assert isinstance(llm.as_structured_llm(Point).complete("point 1 2").raw, Point)
