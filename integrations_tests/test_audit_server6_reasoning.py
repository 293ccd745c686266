"""Audit of `hibana serve` with a reasoning model through its three APIs (chat completions,
Responses, Messages), driven by the real `openai` and `anthropic` clients: a reply's reasoning sent
back as history renders as the chat endpoint renders the same conversation."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from hibana_plugins.server import ServerConfig, serving  # noqa: E402

WEATHER = {"type": "function", "name": "get_weather", "description": "Get the weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    """A client of a server on the tiny Qwen3-style reasoning checkpoint (tests/reasoning_model.py)."""
    import tiny_models
    from reasoning_model import make_reasoning_checkpoint

    engine = tiny_models.open_engine(make_reasoning_checkpoint(tmp_path_factory.mktemp("reasoning") / "m"))
    with engine, serving(engine, ServerConfig("thinker")) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def test_the_reasoning_of_a_turn_cut_inside_it_stays_with_that_turn(client):
    """A response max_output_tokens cut inside its reasoning is one reasoning item; sent back as
    input (`input += response.output`) before the next user message, its text went to the next
    assistant item, a later turn's, whose thinking the template then rendered as both (a prompt
    the model never wrote, recomputed). It is its own turn's, as the chat endpoint reads the same
    history (an assistant message of that reasoning and no content)."""
    cut, later = "The user s", "Now I call the tool."
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'}
    items = [{"role": "user", "content": "hi"},
             {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": cut}]},
             {"role": "user", "content": "go on"},
             {"type": "reasoning", "id": "rs_2", "summary": [], "content": [{"type": "reasoning_text", "text": later}]},
             call, {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    response = client.responses.create(model="thinker", input=items, tools=[WEATHER], max_output_tokens=1)
    tool = {"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}
    chat = client.chat.completions.create(model="thinker", tools=[tool], max_tokens=1, messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "reasoning_content": cut},
        {"role": "user", "content": "go on"},
        {"role": "assistant", "content": None, "reasoning_content": later, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    assert response.usage.input_tokens == chat.usage.prompt_tokens
