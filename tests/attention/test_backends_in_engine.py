from __future__ import annotations

from peregrine import LLM, SamplingParams


def test_triton_backend_generates_the_same_greedy_tokens_as_torch() -> None:
    # NOTE: 16-token steps split the 24-token prompt into chunks (the second after a computed
    # prefix) mixed with decodes, so every path of both backends runs in the real engine.
    prompts = ["The capital of France is a city that lies on the river Seine, and it is", "1 2 3"]
    params = SamplingParams(temperature=0.0, max_tokens=6)
    tokens = {}
    for backend in ("torch", "triton"):
        llm = LLM(attention_backend=backend, device="cpu", enforce_eager=True, block_size=16,
                  max_num_batched_tokens=16, dtype="float32")
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert tokens["triton"] == tokens["torch"]
