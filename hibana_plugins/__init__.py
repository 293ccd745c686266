"""Hibana's plugin system: hook specifications, the plugin manager and the built-in plugins.

Plugins implement hooks marked with `hookimpl`; see `hibana_plugins.hookspecs` for the hooks and
`hibana_plugins.manager.get_plugin_manager()` for what is registered. Importing this package
imports pluggy alone.
"""

from hibana_plugins.hookspecs import hookimpl

__all__ = ["hookimpl"]
