"""The private names llmrun takes from other libraries, each behind one adapter module: these
tests fail when a library moves one of them (pyproject.toml pins the ranges they hold on)."""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap

import pytest
import typer.core
from rich.console import Console
from rich.live import Live
from rich.live_render import LiveRender
from rich.text import Text

from llmrun.cli import rich_adapter
from llmrun.runners import httpx_adapter, hub_adapter, llama_cpp_adapter, re_adapter

from .conftest import HANG_S


def test_rich_live_lock_and_render_region() -> None:
    live = Live(Text("x"), console=Console(file=io.StringIO(), width=40), auto_refresh=False)
    lock = rich_adapter.live_lock(live)
    with lock:  # Live's refresh takes the same lock: held here, a refresh would wait
        pass
    render = rich_adapter.live_render(live)
    assert isinstance(render, LiveRender)
    replacement = LiveRender(Text("y"))
    rich_adapter.set_live_render(live, replacement)
    assert rich_adapter.live_render(live) is replacement


def test_rich_live_render_shape() -> None:
    render = LiveRender(Text("one\ntwo"))
    assert rich_adapter.drawn_shape(render) is None
    Console(file=io.StringIO(), width=40).print(render)
    assert rich_adapter.drawn_shape(render) == (3, 2)
    assert render.last_render_height == 2  # rich's public view of the same figure
    rich_adapter.forget_drawn(render)
    assert render.last_render_height == 0


def test_httpx_proxy_names(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"):
        for variable in (name, name.lower()):
            monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.test:3128")
    monkeypatch.setenv("NO_PROXY", "localhost")
    proxies = httpx_adapter.get_environment_proxies()
    assert proxies["http://"] == "http://proxy.test:3128", proxies
    assert proxies["all://localhost"] is None, proxies
    import httpx2

    assert httpx_adapter.URLPattern("http://").matches(httpx2.URL("http://example.test/v1"))
    assert not httpx_adapter.URLPattern("all://localhost").matches(httpx2.URL("http://x.test"))


def test_huggingface_hub_client_and_retry_names() -> None:
    """The installed huggingface_hub (1.x and later: httpx) has both names; each call changes
    what it says, and the test puts the library's own back."""
    from huggingface_hub.utils import _http

    backoffs = [f.__kwdefaults__ for f in (_http.http_backoff, _http.http_stream_backoff)]
    before = [dict(d) if d else None for d in backoffs]
    seen: list[object] = []
    try:
        assert hub_adapter.retry_at_most(1)
        assert (_http.http_backoff.__kwdefaults__ or {}).get("max_retries") == 1
        assert hub_adapter.hook_every_request(seen.append)
        client = _http.get_session()
        assert seen.append in client.event_hooks["request"]
    finally:
        for defaults, kept in zip(backoffs, before, strict=True):
            if defaults and kept:
                defaults.update(kept)
        _http.set_client_factory(_http.default_client_factory)


def test_re_parser_names() -> None:
    def first(pattern: str) -> object:
        return re_adapter.parse(pattern).data[0][0]

    assert first("a*") in re_adapter.REPEATS and first("a*?") in re_adapter.REPEATS
    assert first("(a)") == re_adapter.SUBPATTERN
    assert first("ab|cd") == re_adapter.BRANCH
    assert first("(?=a)") in re_adapter.ASSERTS and first("(?!a)") in re_adapter.ASSERTS
    if sys.version_info >= (3, 11):
        assert first("a*+") in re_adapter.REPEATS
    # the names runners/grammar._unescaped_in reads, by str(): if one moved, every pattern
    # would pass that check unseen
    assert str(first("a")) == "LITERAL" and str(first("[ab]")) == "IN"
    [(op, _arg)] = re_adapter.parse("[^a-c]").data[0][1][:1]
    assert str(op) == "NEGATE"
    [(op, (low, high))] = re_adapter.parse("[a-c]").data[0][1]
    assert str(op) == "RANGE" and (low, high) == (97, 99)
    [(op, category)] = re_adapter.parse(r"\s").data[0][1]
    assert str(op) == "CATEGORY" and str(category) == "CATEGORY_SPACE"
    assert str(re_adapter.parse(r"\d").data[0][1][0][1]) == "CATEGORY_DIGIT"


def test_llama_cpp_library_handle_and_file() -> None:
    lib = llama_cpp_adapter.libllama()
    assert hasattr(lib, "llama_attach_threadpool") and hasattr(lib, "llama_detach_threadpool")
    path = llama_cpp_adapter.libllama_path()
    if path is not None:  # the file the bindings opened is the one llmrun would open
        assert lib._name == str(path)


def test_llama_cpp_chat_formatter_renders_the_compiled_template() -> None:
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    class Compiled:
        def render(self, **context: object) -> str:
            return f"rendered {len(context['messages'])}"  # type: ignore[arg-type]

    formatter = Jinja2ChatFormatter(template="", eos_token="</s>", bos_token="<s>")
    llama_cpp_adapter.set_compiled_template(formatter, Compiled())
    assert formatter(messages=[{"role": "user", "content": "hi"}]).prompt == "rendered 1"


def test_typer_is_not_patched() -> None:
    """Flags show no type through their metavar (public), not a patch of typer's classes: every
    function on them is typer's own, with llmrun's app and every command's module loaded."""
    import llmrun.cli.app

    for name in llmrun.cli.app.COMMANDS:
        llmrun.cli.app.build_command(name)
    for cls in (
        typer.core.TyperOption,
        typer.core.TyperArgument,
        typer.core.TyperCommand,
        typer.core.TyperGroup,
    ):
        for name, value in vars(cls).items():
            if callable(value):
                assert value.__module__.startswith("typer."), (cls.__name__, name)


def test_doctors_libllama_is_the_bindings_own(llmrun_env: dict[str, str]) -> None:
    """libllama opened through ctypes before `import llama_cpp` is the library the bindings then
    use (one copy, the same answers), and opening it imports neither llama_cpp nor numpy."""
    code = textwrap.dedent(
        """
        import sys
        from llmrun.runners import library
        from llmrun.runners.llama_cpp_adapter import libllama
        bare = library.llama_c_library()
        info, offload = bare.llama_print_system_info(), bare.llama_supports_gpu_offload()
        assert not {"llama_cpp", "numpy"} & set(sys.modules), sorted(sys.modules)
        bindings = library.llama_lib()
        assert libllama()._handle == bare._handle
        assert bindings.llama_print_system_info() == info
        assert bool(bindings.llama_supports_gpu_offload()) == offload
        assert library.llama_c_library() is libllama()
        print("ok")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=llmrun_env, capture_output=True, text=True, timeout=HANG_S
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
