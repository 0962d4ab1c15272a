"""LangChain's `ChatOpenAI` against `llmrun serve`: `with_structured_output` and `bind_tools`.

Issue 31 found both failing (`response_format` and `tools` were refused); they are served by
llama.cpp's grammar sampler now. A client nobody here wrote, with its own request shapes
(`strict` schemas with titles, `parallel_tool_calls`, a named `tool_choice`), checked end to end.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import BaseModel, Field

from .test_serve import Server, llmrun_serve, serve_env  # noqa: F401  (fixture)


class City(BaseModel):
    """A city and whether it is its country's capital."""

    name: str = Field(max_length=16)
    country: str = Field(max_length=16)
    capital: bool


class GetWeather(BaseModel):
    """Get the current weather in a city."""

    city: str = Field(max_length=20)
    unit: str = Field(json_schema_extra={"enum": ["celsius", "fahrenheit"]})


@pytest.fixture(scope="module")
def server(serve_env: dict[str, str]) -> Iterator[Server]:  # noqa: F811
    with llmrun_serve(serve_env, "--no-dashboard") as s:
        yield s


def chat_model(server: Server) -> Any:
    # Imported here, not at the top: LangChain's import took a third of the suite's collection
    # (every `pytest` start, the quick subset's included). The dev extra installs it: a broken
    # install fails these tests, never skips them.
    import langchain_openai

    settings: dict[str, Any] = {  # as a user writes them (pydantic reads the aliases)
        "base_url": server.url + "/v1",
        "api_key": "none",
        "model": server.get("/v1/models")["data"][0]["id"],
        "temperature": 0,
        "max_tokens": 120,
        "max_retries": 0,
    }
    return langchain_openai.ChatOpenAI(**settings)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output_gives_the_model(server: Server, method: str) -> None:
    structured = chat_model(server).with_structured_output(City, method=method)
    city = structured.invoke("Name a capital city.")
    assert isinstance(city, City)


def test_bind_tools_gives_a_call_with_arguments_the_schema_accepts(server: Server) -> None:
    bound = chat_model(server).bind_tools([GetWeather], tool_choice="GetWeather")
    message = bound.invoke("What is the weather in Paris?")
    (call,) = message.tool_calls
    assert call["name"] == "GetWeather"
    GetWeather.model_validate(call["args"])
    forced = chat_model(server).bind_tools([GetWeather], tool_choice="any")
    assert forced.invoke("Weather in Oslo?").tool_calls[0]["name"] == "GetWeather"
