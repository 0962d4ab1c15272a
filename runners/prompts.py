"""A request's prompt as text and tokens: raw, or its messages through the model's chat
template (ChatML where the model has none), rendered with a budget (template.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .base import Request
from .errors import BadRequestError, ChatTemplateError, EmptyPromptError
from .handles import Model
from .library import llama_lib

# Used when a model has no chat template of its own (llama.cpp falls back to ChatML too).
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def formatter_for(model: Model, template: str | None) -> Any:
    """The chat template (ChatML when None) compiled, with the model's BOS and EOS text."""
    from .template import bounded_formatter

    lib = llama_lib()
    vocab = model.vocab
    bos = model.to_piece(lib.llama_vocab_bos(vocab), special=True).decode(errors="replace")
    eos = model.to_piece(lib.llama_vocab_eos(vocab), special=True).decode(errors="replace")
    return bounded_formatter(template or CHATML_TEMPLATE, eos_token=eos, bos_token=bos)


class Prompts:
    """Renders and tokenizes requests; the template is compiled once, on first use, by
    `formatter` (a callable, as the weights may load after this is made)."""

    def __init__(
        self,
        formatter: Callable[[], Any],
        tokenize: Callable[[str, bool], list[int]],
        whose: str = "the model's chat template",
    ) -> None:
        self._make_formatter, self._tokenize = formatter, tokenize
        self._formatter: Any = None
        self.whose = whose  # named when the template fails

    def render(self, request: Request) -> str:
        """The prompt text a request stands for: raw, or its messages through the template."""
        if request.prompt is not None:
            return request.prompt
        messages = [{"role": m.role, "content": m.content} for m in request.messages]
        from .template import MAX_OUTPUT_CHARS

        size = sum(len(m.content) for m in request.messages)
        if size > MAX_OUTPUT_CHARS:  # the template's budget would blame the template
            raise BadRequestError(
                f"the messages hold {size:,} characters: more than any context holds, and"
                f" than a chat template may write ({MAX_OUTPUT_CHARS:,})"
            )
        try:
            if self._formatter is None:
                self._formatter = self._make_formatter()
            switch: dict[str, Any] = (
                {}
                if request.sampling.think is None
                else {"enable_thinking": request.sampling.think}
            )
            if request.tools:  # the template's own tool syntax (serving/tools.py)
                switch["tools"] = list(request.tools)
            return str(self._formatter(messages=messages, **switch).prompt)
        except ChatTemplateError:  # the template refused before Jinja saw it: says so itself
            raise
        except Exception as e:  # jinja2's TemplateError and whatever a template raises
            first = (str(e).splitlines() or [""])[0]
            raise ChatTemplateError(f"{type(e).__name__}: {first}", self.whose) from None

    def text_and_tokens(self, request: Request) -> tuple[str, list[int]]:
        """The rendered prompt (empty for token ids) and its tokens."""
        if request.token_ids is not None:
            return "", list(request.token_ids)
        text = self.render(request)
        if not text.strip():
            raise EmptyPromptError()
        # A chat template writes its own BOS; a raw prompt gets the model's usual specials.
        return text, self._tokenize(text, request.prompt is not None)
