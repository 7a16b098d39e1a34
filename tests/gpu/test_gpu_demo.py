"""The packaged demo model and draft on CUDA: the Triton backend (CUDA graphs) agrees with the
torch backend, and both models write code-like text."""
from __future__ import annotations

import gc

import pytest
import torch

from peregrine import LLM, SamplingParams
from peregrine import demo

pytestmark = pytest.mark.gpu

PROMPTS = ["def fibonacci(n):", "class Stack:\n    def __init__(self):",
           "import os\n\n\ndef read_lines(path):\n    \"\"\"", "    for i in range(10):"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


def _greedy(path: str, **engine_args) -> list[tuple[list[int], str]]:
    llm = LLM(path, num_gpu_blocks_override=256, seed=0, **engine_args)
    try:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        return [(list(o.outputs[0].token_ids), o.outputs[0].text) for o in outs]
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()


@pytest.mark.parametrize("which", ["model", "draft"])
def test_triton_graphs_match_torch_backend_in_float32(which: str) -> None:
    path = str(demo.demo_model_path() if which == "model" else demo.demo_draft_path())
    want = _greedy(path, dtype="float32", attention_backend="torch", enforce_eager=True)
    got = _greedy(path, dtype="float32", attention_backend="triton")
    assert [t for t, _ in got] == [t for t, _ in want]


def test_bf16_demo_writes_code_like_text() -> None:
    outs = _greedy(str(demo.demo_model_path()), dtype="bfloat16")
    for prompt, (_, text) in zip(PROMPTS, outs):
        assert "\n" in text and any(s in text for s in ("return", "(", ":", "=")), (prompt, text)
