"""The names llmrun takes from inside httpx2 (`httpx2._utils`): how it reads the proxy
variables (HTTP_PROXY, HTTPS_PROXY, ALL_PROXY, NO_PROXY) and matches a URL against them, so
that `remote.environment_proxy` finds the proxy httpx will use, and the variable that named
it, before httpx fails on one. Every name used is here; tests/test_adapters.py fails when one of
them moves (pyproject.toml pins httpx2>=2,<3).
"""

from __future__ import annotations

from httpx2._utils import URLPattern, get_environment_proxies

__all__ = ["URLPattern", "get_environment_proxies"]
