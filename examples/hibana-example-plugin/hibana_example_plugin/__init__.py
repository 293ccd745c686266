"""Example Hibana plugin: the hook implementations Hibana finds through the entry point."""

from hibana_plugins import hookimpl

from hibana_example_plugin.adapter import ExampleAdapter
from hibana_example_plugin.parser import ExampleXmlToolParser

__version__ = "0.1.0"


@hookimpl
def register_tool_parsers(register):
    register("example_xml", ExampleXmlToolParser())


@hookimpl
def register_adapters(register):
    register("example", ExampleAdapter)
