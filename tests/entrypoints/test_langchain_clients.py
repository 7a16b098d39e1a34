"""LangChain's OpenAI chat client against the real server: structured output and forced tool
calls come back parsed (the server decodes them under a JSON-schema grammar)."""
from __future__ import annotations

from typing import Literal

import pytest
from pydantic import BaseModel, Field

from server_utils import TINY_MODEL_NAME as MODEL

langchain_openai = pytest.importorskip("langchain_openai")  # in the test extra; CI installs it


class Verdict(BaseModel):
    """A yes/no answer."""

    answer: Literal["yes", "no"] = Field(description="the answer")


def _chat(real_server):
    return langchain_openai.ChatOpenAI(base_url=real_server.base_url + "/v1", api_key="unused",
                                       model=MODEL, max_tokens=32, temperature=0.0,
                                       max_retries=0, timeout=120)


def test_with_structured_output_returns_the_pydantic_object(real_server) -> None:
    structured = _chat(real_server).with_structured_output(Verdict, method="json_schema")
    got = structured.invoke("Is the sky blue?")
    assert isinstance(got, Verdict) and got.answer in ("yes", "no")


def test_bind_tools_with_a_named_tool_returns_its_call(real_server) -> None:
    def pick_city(city: Literal["Paris", "Rome"]) -> str:
        """Pick a city."""
        return city

    bound = _chat(real_server).bind_tools([pick_city], tool_choice="pick_city")
    msg = bound.invoke("Where should I go?")
    assert len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    assert call["name"] == "pick_city" and call["args"]["city"] in ("Paris", "Rome")
    assert call["id"]
