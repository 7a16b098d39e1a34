"""cache_salt end to end: prefix-cache hits (engine stats, RequestOutput.num_cached_tokens) only
between requests with the same salt, and the same tokens either way."""
from __future__ import annotations

import pytest

from peregrine import LLM, SamplingParams
from peregrine.testing.checkpoints import tiny_checkpoint

_PROMPT = [(11 + 7 * i) % 500 + 5 for i in range(40)]  # two full 16-token blocks and 8 more


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(tiny_checkpoint("llama"), dtype="float32", device="cpu", max_model_len=128,
               block_size=16)


def _run(llm: LLM, salt: str | None) -> tuple[int, int, list[int]]:
    """(prefix-cache hit tokens counted by the engine for this request, the request's own
    num_cached_tokens, its greedy tokens)."""
    before = llm.engine.get_stats().prefix_cache_hits
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, cache_salt=salt)
    out = llm.generate([_PROMPT], sp, use_tqdm=False)[0]
    return llm.engine.get_stats().prefix_cache_hits - before, out.num_cached_tokens, \
        out.outputs[0].token_ids


def test_salted_requests_share_only_with_their_own_salt(llm: LLM) -> None:
    llm.engine.core_client.core.scheduler.reset_prefix_cache()
    hits, cached, tokens = _run(llm, "tenant-a")
    assert (hits, cached) == (0, 0)
    assert _run(llm, "tenant-a")[:2] == (32, 32)  # same salt: both full blocks
    assert _run(llm, "tenant-b")[:2] == (0, 0)  # another salt: nothing
    assert _run(llm, None)[:2] == (0, 0)  # no salt: nothing salted
    assert _run(llm, None)[:2] == (32, 32)  # but the unsalted blocks now
    assert _run(llm, "tenant-b")[:2] == (32, 32)
    assert all(_run(llm, s)[2] == tokens for s in ("tenant-a", "tenant-c"))


def test_n_copies_of_a_salted_request_share_its_blocks(llm: LLM) -> None:
    llm.engine.core_client.core.scheduler.reset_prefix_cache()
    sp = SamplingParams(n=2, temperature=0.0, max_tokens=4, ignore_eos=True, cache_salt="fork")
    out = llm.generate([_PROMPT], sp, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == out.outputs[1].token_ids
    assert _run(llm, "fork")[:2] == (32, 32)


@pytest.mark.parametrize("salt", ["", "x" * 1025, 7])
def test_malformed_salts_are_refused(salt) -> None:
    with pytest.raises(ValueError, match="cache_salt"):
        SamplingParams(cache_salt=salt)
