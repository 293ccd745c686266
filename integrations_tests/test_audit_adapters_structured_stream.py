"""A structured answer's stream raises at its end where `invoke` raises (an answer max_tokens or a
stop cut), as ChatOpenAI's stream raises LengthFinishReasonError at its end: the stream of a cut
answer ended without a word, nothing yielded where the cut call had sent no chunk."""

from __future__ import annotations

import pytest
from langchain_core.exceptions import OutputParserException
from pydantic import BaseModel

from hibana_core import Engine
from hibana_plugins.langchain import ChatHibana

METHODS = ["function_calling", "json_schema", "json_mode"]


class Person(BaseModel):
    """A person."""

    name: str
    age: int


@pytest.fixture(scope="module")
def engine():
    return Engine.shared("demo")


def outcome(run):
    try:
        return run()
    except OutputParserException:
        return "raised"


@pytest.mark.parametrize("method", METHODS)
def test_a_cut_answers_stream_raises_at_its_end_as_invoke_does(engine, method):
    # cut before the call's first chunk, inside its arguments, and at their end
    for max_tokens in (6, 9, 12, 15, 18, 64):
        structured = ChatHibana(engine=engine, max_tokens=max_tokens).with_structured_output(Person, method=method)
        invoked = outcome(lambda: structured.invoke("Alice is 30"))
        streamed = outcome(lambda: list(structured.stream("Alice is 30"))[-1])
        assert streamed == invoked, max_tokens
    assert invoked != "raised" and streamed == invoked  # (the last one long enough for a whole answer)


@pytest.mark.parametrize("method", METHODS)
async def test_a_cut_answers_async_stream_raises_at_its_end(engine, method):
    structured = ChatHibana(engine=engine, max_tokens=8).with_structured_output(Person, method=method)
    with pytest.raises(OutputParserException):
        [part async for part in structured.astream("Alice is 30")]


@pytest.mark.parametrize("method", METHODS)
def test_a_whole_answers_stream_ends_with_invokes_answer(engine, method):
    structured = ChatHibana(engine=engine, max_tokens=64).with_structured_output(Person, method=method)
    assert list(structured.stream("Alice is 30"))[-1] == structured.invoke("Alice is 30")


@pytest.mark.parametrize("method", METHODS)
def test_include_raws_stream_of_a_cut_answer_still_never_raises(engine, method):
    # its raw chunks go out before the parse ends, where LangChain's fallbacks no longer catch
    structured = ChatHibana(engine=engine, max_tokens=8).with_structured_output(Person, method=method,
                                                                                include_raw=True)
    parts = list(structured.stream("Alice is 30"))
    assert parts[0]["raw"] is not None and structured.invoke("Alice is 30")["parsing_error"] is not None
