"""The LangChain adapter's registration, apart from the adapter: `ChatHibana` subclasses
langchain-core's chat model, so importing it imports langchain-core (0.3-1 s). The plugin manager
imports every built-in at an engine's start, and an engine that serves the server, LlamaIndex or
the demo never needs LangChain: the adapter module is imported when the adapters are first asked
for, not before."""

from __future__ import annotations

from hibana_plugins.hookspecs import hookimpl


@hookimpl
def register_adapters(register) -> None:
    from hibana_plugins.langchain import ChatHibana

    register("langchain", ChatHibana)
