"""xgrammar, imported where first needed, and its error messages without their C++ source
locations."""

from __future__ import annotations

import re

from hibana_core.errors import GrammarError

_CPP_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def _message(exc: BaseException) -> str:
    """xgrammar's error, without its time stamp and C++ source location."""
    return _CPP_PREFIX.sub("", str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc))


def _xgrammar():
    try:
        import xgrammar
    except ImportError as exc:  # a core dependency; a broken install says how to mend it
        raise GrammarError(f"constrained decoding needs xgrammar ({exc}); pip install 'xgrammar>=0.2.9'") from exc
    return xgrammar
