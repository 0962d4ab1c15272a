"""Chat templates rendered with a budget: a template is code, and it can come inside a GGUF.

llama-cpp-python renders templates in Jinja's immutable sandbox, which stops a template from
reaching Python's internals and caps one `range()` at 100,000 items, but not nested loops
(`range(99999)` inside `range(99999)`: 10^10 steps) nor a string multiplied into gigabytes. Here
every render has three limits, each ending in an error (a ChatTemplateError for the caller):

- steps: lines of the template's own code executed, counted by a trace function that watches
  the template's frames only (a few microseconds per render for a real template);
- size: `*`, `**`, `+` and `~` may not make a string, list or number beyond the output cap;
- output: the rendered prompt may not exceed MAX_OUTPUT_CHARS.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

MAX_STEPS = 2_000_000  # a real template takes hundreds to a few thousand per message
MAX_OUTPUT_CHARS = 64 * 2**20  # far beyond any context llama.cpp loads (in characters)
TEMPLATE_FILE = "<template>"  # the file name Jinja gives code compiled from a string


class TemplateBudgetError(RuntimeError):
    """A template that would run too long or build too much; the message says which."""


def _sized(value: Any) -> int:
    if isinstance(value, (str, bytes, list, tuple)):
        return len(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value.bit_length() // 8
    return 0


def _make_environment() -> Any:
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            if operator == "**" and isinstance(right, int) and right > 4096:
                raise TemplateBudgetError(f"the chat template raises a number to {right}")
            if operator == "*":
                for a, b in ((left, right), (right, left)):
                    if isinstance(b, int) and _sized(a) * max(b, 0) > MAX_OUTPUT_CHARS:
                        raise TemplateBudgetError(
                            "the chat template builds a value larger than"
                            f" {MAX_OUTPUT_CHARS:,} characters"
                        )
            result = super().call_binop(context, operator, left, right)
            if _sized(result) > MAX_OUTPUT_CHARS:
                raise TemplateBudgetError(
                    f"the chat template builds a value larger than {MAX_OUTPUT_CHARS:,} characters"
                )
            return result

    return BoundedEnvironment, jinja2


class _Budget:
    """A trace function that counts the template's lines and stops it past MAX_STEPS."""

    def __init__(self, max_steps: int) -> None:
        self.steps = 0
        self.max_steps = max_steps

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Callable[..., Any] | None:
        if frame.f_code.co_filename != TEMPLATE_FILE:
            return None  # not the template's own code: no line tracing there
        return self._line

    def _line(self, frame: FrameType, event: str, arg: Any) -> Callable[..., Any] | None:
        if event == "line":
            self.steps += 1
            if self.steps > self.max_steps:
                raise TemplateBudgetError(
                    f"the chat template runs past {self.max_steps:,} steps (loops too deep?)"
                )
        return self._line


class _BoundedTemplate:
    """A compiled template whose `render` streams under the step budget and the output cap."""

    def __init__(self, template: Any, max_steps: int) -> None:
        self.template = template
        self.max_steps = max_steps

    def render(self, **context: Any) -> str:
        parts: list[str] = []
        size = 0
        previous = sys.gettrace()
        sys.settrace(_Budget(self.max_steps))
        try:
            pieces: Iterator[str] = self.template.generate(**context)
            for piece in pieces:
                size += len(piece)
                if size > MAX_OUTPUT_CHARS:
                    raise TemplateBudgetError(
                        f"the chat template writes more than {MAX_OUTPUT_CHARS:,} characters"
                    )
                parts.append(piece)
        finally:
            sys.settrace(previous)
        return "".join(parts)


def bounded_formatter(
    template: str, *, eos_token: str, bos_token: str, max_steps: int = MAX_STEPS
) -> Any:
    """llama-cpp-python's Jinja2ChatFormatter (same globals, filters and extensions, the same
    output) with its template compiled in the bounded sandbox."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    from .llama_cpp_adapter import set_compiled_template

    # Built on an empty template: compiling the real one in the library's environment would
    # fold its constant expressions ('a' * 10**9) before any limit applies.
    formatter = Jinja2ChatFormatter(template="", eos_token=eos_token, bos_token=bos_token)
    formatter.template = template
    environment_class, jinja2 = _make_environment()
    environment = environment_class(
        loader=jinja2.BaseLoader(),
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[Jinja2ChatFormatter.IgnoreGenerationTags, jinja2.ext.loopcontrols],
    )
    environment.filters["tojson"] = Jinja2ChatFormatter.tojson
    compiled = environment.from_string(template)
    namespace = compiled.root_render_func.__globals__  # the template module's own names
    for name in ("str_join", "markup_join"):  # `~` concatenation: sized like `+`
        if name in namespace:
            namespace[name] = _bounded_join(namespace[name])
    set_compiled_template(formatter, _BoundedTemplate(compiled, max_steps))
    return formatter


def _bounded_join(join: Callable[[Any], str]) -> Callable[[Any], str]:
    def bounded(seq: Any) -> str:
        result = join(seq)
        if len(result) > MAX_OUTPUT_CHARS:
            raise TemplateBudgetError(
                f"the chat template builds a value larger than {MAX_OUTPUT_CHARS:,} characters"
            )
        return result

    return bounded
