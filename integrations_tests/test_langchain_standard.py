"""LangChain's standard chat-model suites (langchain-tests) on ChatHibana and the demo model (CPU).

No test is marked xfail: every test passes as the suite ships it, except the multimodal ones the
suite itself skips (the demo model is text only).
"""

from __future__ import annotations

from pathlib import Path



from langchain_core.language_models import BaseChatModel  # noqa: E402
from langchain_tests.integration_tests import ChatModelIntegrationTests  # noqa: E402
from langchain_tests.unit_tests import ChatModelUnitTests  # noqa: E402

import hibana_core  # noqa: E402
from hibana_plugins.langchain import ChatHibana  # noqa: E402

DEMO_CHECKPOINT = str(Path(hibana_core.__file__).parent / "demo" / "model")

# The demo model was trained on synthetic tasks whose argument values appear in plain questions
# ("What is 3 plus 5?", "Weather in Paris?"), all in ASCII (hibana_core/demo/tasks.py).
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
