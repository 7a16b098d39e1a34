"""Streamed chunks as OpenAI sends them, read raw off the wire and through the openai client's
own streaming types: usage only when asked for, the role only in each choice's first delta."""
from __future__ import annotations

import json

import httpx
import pytest
from openai.types.chat import ChatCompletionChunk

from server_utils import TINY_MODEL_NAME as MODEL

CHAT = [{"role": "user", "content": "Tell me about falcons."}]


def _events(server, path: str, body: dict) -> list[dict]:
    """The JSON of every SSE event before [DONE] (which must close the stream)."""
    with httpx.stream("POST", server.base_url + path, json={"model": MODEL, "stream": True, **body},
                      timeout=60) as r:
        assert r.status_code == 200
        data = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


@pytest.mark.parametrize("n", [1, 2])
def test_chat_chunks_parse_and_carry_the_role_once_per_choice(real_server, n):
    events = _events(real_server, "/v1/chat/completions",
                     {"messages": CHAT, "max_tokens": 5, "n": n, "seed": 3})
    roles: dict[int, int] = {}
    first_seen: set[int] = set()
    for e in events:
        ChatCompletionChunk.model_validate(e)
        assert e["object"] == "chat.completion.chunk" and "usage" not in e
        for choice in e["choices"]:
            delta, k = choice["delta"], choice["index"]
            assert None not in delta.values()  # a delta holds only the fields it sets
            if "role" in delta:
                assert k not in first_seen, "role after the choice's first delta"
                roles[k] = roles.get(k, 0) + 1
            first_seen.add(k)
    assert roles == {k: 1 for k in range(n)}
    finishes = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert sorted(finishes) == ["length"] * n


def test_include_usage_adds_one_final_chunk_with_empty_choices(real_server):
    events = _events(real_server, "/v1/chat/completions",
                     {"messages": CHAT, "max_tokens": 4, "stream_options": {"include_usage": True}})
    *body, last = events
    assert all("usage" in e and e["usage"] is None for e in body)
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 4
    ChatCompletionChunk.model_validate(last)


def test_completion_chunks_leave_usage_out_unless_asked(real_server):
    plain = _events(real_server, "/v1/completions", {"prompt": "The quick", "max_tokens": 3})
    assert plain and all("usage" not in e for e in plain)
    for e in plain:
        # NOTE: openai's Completion type wants a finish_reason; OpenAI streams null until the end
        # (the client builds chunks without validating), so the keys are checked instead.
        assert e["object"] == "text_completion"
        for c in e["choices"]:
            assert {"index", "text", "logprobs", "finish_reason"} <= set(c)
            assert "prompt_logprobs" not in c
    asked = _events(real_server, "/v1/completions", {"prompt": "The quick", "max_tokens": 3,
                                                     "stream_options": {"include_usage": True}})
    assert all(e["usage"] is None for e in asked[:-1])
    assert asked[-1]["choices"] == [] and asked[-1]["usage"]["completion_tokens"] == 3
