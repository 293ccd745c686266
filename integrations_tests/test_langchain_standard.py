"""LangChain's standard chat-model suites (langchain-tests) on ChatHibana and the demo model (CPU).

A test is marked xfail only where it asks for something the 7M-parameter demo model cannot do;
the reason is on each mark. Everything else passes as the suite ships it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("langchain_tests")

from langchain_core.language_models import BaseChatModel  # noqa: E402
from langchain_tests.integration_tests import ChatModelIntegrationTests  # noqa: E402
from langchain_tests.unit_tests import ChatModelUnitTests  # noqa: E402

import hibana_core  # noqa: E402
from hibana_plugins.langchain import ChatHibana  # noqa: E402

DEMO_CHECKPOINT = str(Path(hibana_core.__file__).parent / "demo" / "model")

# The demo model was trained on synthetic tasks whose argument values appear in plain questions
# ("What is 3 plus 5?", "Weather in Paris?"), all in ASCII (hibana_core/demo/tasks.py).
NO_CALL_SYNTAX = ("the demo model never saw a value given in call syntax ('magic_function(3)'): "
                  "the forced call has the right name and keys, but the model does not read 3 "
                  "out of the question")
NO_CJK = ("the demo model's training text is ASCII only: it cannot copy Chinese or Japanese "
          "names into an argument (the forced call has the right name and keys)")


class TestChatHibanaUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[BaseChatModel]:
        return ChatHibana

    @property
    def chat_model_params(self) -> dict:
        return {"model": "demo"}


class TestChatHibanaIntegration(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[BaseChatModel]:
        return ChatHibana

    @property
    def chat_model_params(self) -> dict:
        return {"model": "demo", "max_tokens": 64}

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def model_override_value(self) -> str:
        return DEMO_CHECKPOINT  # the same weights loaded by path: a second engine

    @property
    def supported_usage_metadata_details(self) -> dict:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False):
        llm = ChatHibana(**self.chat_model_params)
        question = "What's the weather in Paris?"
        llm.invoke(question)  # the second call finds the first one's state
        if not stream:
            return llm.invoke(question)
        full = None
        for chunk in llm.stream(question):
            full = chunk if full is None else full + chunk
        return full

    @pytest.mark.xfail(reason=NO_CALL_SYNTAX)
    @pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)
    def test_tool_calling(self, model: BaseChatModel) -> None:
        super().test_tool_calling(model)

    @pytest.mark.xfail(reason=NO_CALL_SYNTAX)
    async def test_tool_calling_async(self, model: BaseChatModel) -> None:
        await super().test_tool_calling_async(model)

    @pytest.mark.xfail(reason=NO_CJK)
    def test_unicode_tool_call_integration(self, model: BaseChatModel, *, tool_choice: str | None = None,
                                           force_tool_call: bool = True) -> None:
        super().test_unicode_tool_call_integration(model, tool_choice=tool_choice, force_tool_call=force_tool_call)
