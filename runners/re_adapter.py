"""The parser of Python's own `re`, which the standard library keeps private: `re._parser` since
Python 3.11, `sre_parse` before. `devices.check_tensor_pattern` walks its parse tree to refuse
a pattern that llama.cpp's backtracking matcher could take for ever over. Every name used is
here; tests/test_adapters.py fails when one of them moves (Python itself is the pin:
requires-python in pyproject.toml).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

_parser: Any = importlib.import_module("re._parser" if sys.version_info >= (3, 11) else "sre_parse")

# The operators of the parse tree that devices.check_tensor_pattern looks at.
REPEATS = tuple(
    getattr(_parser, name)
    for name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT")
    if hasattr(_parser, name)  # POSSESSIVE_REPEAT (a*+) is new in Python 3.11
)
SUBPATTERN = _parser.SUBPATTERN
BRANCH = _parser.BRANCH
ASSERTS = (_parser.ASSERT, _parser.ASSERT_NOT)


def parse(pattern: str) -> Any:
    """The parse tree of a pattern (its `.data`: a list of (operator, argument) pairs); raises
    re.error as re.compile does."""
    return _parser.parse(pattern)
