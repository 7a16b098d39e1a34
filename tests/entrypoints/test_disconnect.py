"""64 concurrent streams, a quarter of the clients leave midway: the rest finish and nothing leaks."""
from __future__ import annotations

import asyncio
import time

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from server_utils import TINY_MODEL_NAME as MODEL

NUM_STREAMS = 64
MAX_TOKENS = 24


def _gauges(base_url: str) -> dict[str, float]:
    text = httpx.get(base_url + "/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + (f"[{s.labels['finished_reason']}]" if "finished_reason" in s.labels else "")
            out[key] = s.value
    return out


async def _client_run(client: openai.AsyncOpenAI, i: int, leave: bool) -> str | None:
    stream = await client.completions.create(model=MODEL, prompt=f"Story number {i}:",
                                             max_tokens=MAX_TOKENS, stream=True,
                                             extra_body={"ignore_eos": True})
    finish = None
    received = 0
    async for chunk in stream:
        received += 1
        if leave and received == 3:
            await stream.close()  # drop the connection mid-stream
            return "left"
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    return finish


def test_disconnecting_clients_free_everything(real_server):
    base = real_server.base_url
    before = _gauges(base)

    async def main():
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        try:
            return await asyncio.gather(*[_client_run(client, i, leave=i % 4 == 0)
                                          for i in range(NUM_STREAMS)])
        finally:
            await client.close()
    results = asyncio.run(main())
    assert results.count("left") == NUM_STREAMS // 4
    assert results.count("length") == NUM_STREAMS - NUM_STREAMS // 4

    deadline = time.monotonic() + 10
    while True:
        g = _gauges(base)
        idle = (g["peregrine_kv_cache_usage_ratio"] == 0 and g["peregrine_num_requests_running"] == 0
                and g["peregrine_num_requests_waiting"] == 0)
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert g["peregrine_kv_cache_usage_ratio"] == 0
    assert g["peregrine_num_requests_running"] == 0
    assert g["peregrine_num_requests_waiting"] == 0
    aborted = g["peregrine_request_success_total[abort]"] - before["peregrine_request_success_total[abort]"]
    assert aborted == NUM_STREAMS // 4
    assert httpx.get(base + "/health").status_code == 200
    after = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert after.status_code == 200


def test_non_streaming_client_timeout_aborts_its_request():
    from fake_engine import FakeEngine
    from server_utils import RunningServer

    engine = FakeEngine(step_delay=0.01)
    with RunningServer(engine) as s:
        try:
            httpx.post(s.base_url + "/v1/completions", timeout=0.3,
                       json={"model": "fake-model", "prompt": "hi", "max_tokens": 120})
        except httpx.ReadTimeout:
            pass
        else:
            raise AssertionError("the request should still be running at the timeout")
        deadline = time.monotonic() + 5
        while engine.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not engine.has_unfinished_requests()
        assert _gauges(s.base_url)["peregrine_request_success_total[abort]"] == 1
