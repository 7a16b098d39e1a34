"""LLM.generate takes vLLM's prompt forms and refuses anything else with a TypeError."""
from __future__ import annotations

import pytest

from peregrine import LLM, SamplingParams
from peregrine.testing.checkpoints import tiny_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(tiny_checkpoint("llama"), dtype="float32", device="cpu", max_model_len=64)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_prompt_dicts_mean_what_they_say(llm: LLM) -> None:
    text, ids = "hello there", [5, 6, 7]
    assert _tokens(llm.generate({"prompt": text}, GREEDY, use_tqdm=False)) == \
        _tokens(llm.generate(text, GREEDY, use_tqdm=False))
    assert llm.generate({"prompt": text}, GREEDY, use_tqdm=False)[0].prompt == text
    assert _tokens(llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)) == \
        _tokens(llm.generate(ids, GREEDY, use_tqdm=False))
    mixed = llm.generate([{"prompt": text}, {"prompt_token_ids": ids}, ids, text], GREEDY,
                         use_tqdm=False)
    assert [o.prompt_token_ids for o in mixed][1:3] == [ids, ids] and len(mixed) == 4


@pytest.mark.parametrize("bad", [{"text": "hi"}, {"prompt": "a", "prompt_token_ids": [1]},
                                 {"prompt": 5}, 42, [1.5, 2.0], [[1, 2], "x", 3], None,
                                 {"prompt_token_ids": ["a"]}, [True, False]])
def test_anything_else_is_a_type_error(llm: LLM, bad) -> None:
    with pytest.raises(TypeError):
        llm.generate(bad, GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
