"""The names llmrun takes from inside huggingface_hub (`huggingface_hub.utils._http`): its
default HTTP client, to add a request hook to it, and its retry functions' default count, both
set once before the first request to the Hub (`models._bounded_hub`). Every name used is here;
tests/test_adapters.py fails when one of them moves. pyproject.toml allows huggingface_hub
0.34 to 2.x: where a name is not there (the 0.x releases sent their requests through
`requests`), the setting is left as the library has it and False says so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _http() -> Any:
    from huggingface_hub.utils import _http

    return _http


def hook_every_request(hook: Callable[[Any], None]) -> bool:
    """`hook` runs on each request huggingface_hub's client sends from now on."""
    import huggingface_hub

    http = _http()
    default = getattr(http, "default_client_factory", None)
    set_factory = getattr(huggingface_hub, "set_client_factory", None)
    if default is None or set_factory is None:
        return False

    def client() -> Any:
        made = default()
        made.event_hooks["request"].append(hook)
        return made

    set_factory(client)
    return True


def retry_at_most(times: int) -> bool:
    """huggingface_hub's requests retry a failure `times` times, not its own 5."""
    http = _http()
    done = False
    for name in ("http_backoff", "http_stream_backoff"):
        defaults = getattr(getattr(http, name, None), "__kwdefaults__", None)
        if defaults and "max_retries" in defaults:
            defaults["max_retries"] = times
            done = True
    return done
