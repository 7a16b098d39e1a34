from __future__ import annotations

import pytest
import torch

from peregrine import LLM, SamplingParams
from peregrine.attention import get_attention_backend


@pytest.mark.slow
@pytest.mark.parametrize("pieces", [False, True], ids=["plain", "piecewise"])
def test_triton_backend_generates_the_same_greedy_tokens_as_torch(pieces: bool) -> None:
    # NOTE: 16-token steps split the 24-token prompt into chunks (the second after a computed
    # prefix) mixed with decodes, so every path of both backends runs in the real engine.
    # "piecewise" runs the Triton side through the piecewise-graph path (pieces eager on CPU):
    # K/V stored by the pieces, decodes folded into the extend kernel, padded token counts.
    from peregrine.worker.cuda_graphs import PiecewiseGraphs, prefill_graph_sizes
    prompts = ["The capital of France is a city that lies on the river Seine, and it is", "1 2 3"]
    params = SamplingParams(temperature=0.0, max_tokens=6)
    tokens = {}
    for backend in ("torch", "triton"):
        llm = LLM(attention_backend=backend, device="cpu", enforce_eager=True, block_size=16,
                  max_num_batched_tokens=16, dtype="float32")
        if pieces and backend == "triton":
            runner = llm.engine.core_client.core.executor.worker.model_runner
            pw = PiecewiseGraphs(runner.model, runner.buffers, runner.kv_caches,
                                 prefill_graph_sizes(16), capture=False)
            run, padded_steps = pw.run, []

            def poisoned_run(num_tokens, meta):
                # The shared attention output holds NaN from "earlier steps": its padding rows
                # must come out zero (zeroed once per step, then left alone by every layer).
                pw.o.fill_(float("nan"))
                hidden = run(num_tokens, meta)
                n = pw.padded(num_tokens)
                assert not meta.out_padding_zeroed
                assert torch.equal(pw.o[num_tokens:n], torch.zeros_like(pw.o[num_tokens:n]))
                assert not torch.isnan(pw.o[:num_tokens]).any()
                padded_steps.append(n > num_tokens)
                return hidden

            pw.run = poisoned_run
            runner.prefill_graphs = pw
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert tokens["triton"] == tokens["torch"]
    if pieces:
        assert any(padded_steps), "no padded piecewise step ran"


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_backends_write_into_a_given_out_buffer(name: str, monkeypatch) -> None:
    """Piecewise CUDA graphs pass a fixed output buffer: the backend fills it (padding rows with
    zeros, whatever was there before) and returns it, with the same values as without it."""
    from step_cases import make_step
    monkeypatch.setenv("PEREGRINE_DEBUG_CHECKS", "1")  # for the bad out buffer below
    backend = get_attention_backend(name)
    step = make_step(prefix_lens=[0, 30, 21, 0], q_lens=[1, 1, 13, 9], num_pad_tokens=3)
    want = backend.forward(step.q, step.k, step.v, step.k_cache, step.v_cache, step.meta, 0.125)
    out = torch.full_like(step.q, float("nan"))
    got = backend.forward(step.q, step.k, step.v, step.k_cache, step.v_cache, step.meta, 0.125,
                          out=out)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="out"):
        backend.forward(step.q, step.k, step.v, step.k_cache, step.v_cache, step.meta, 0.125,
                        out=out[:-1])


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_store_first_then_attend_equals_the_one_call(name: str, monkeypatch) -> None:
    """Piecewise graphs store K/V inside a graph and call attention with k = v = None."""
    from step_cases import make_step
    monkeypatch.setenv("PEREGRINE_DEBUG_CHECKS", "1")  # for the lone v below
    backend = get_attention_backend(name)
    args = dict(prefix_lens=[0, 30, 21, 0], q_lens=[1, 1, 13, 9], num_pad_tokens=3)
    one, two = make_step(**args), make_step(**args)
    want = backend.forward(one.q, one.k, one.v, one.k_cache, one.v_cache, one.meta, 0.125)
    backend.store_kv(two.k, two.v, two.k_cache, two.v_cache, two.meta.slot_mapping)
    got = backend.forward(two.q, None, None, two.k_cache, two.v_cache, two.meta, 0.125)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.equal(two.k_cache, one.k_cache) and torch.equal(two.v_cache, one.v_cache)
    with pytest.raises(ValueError, match="both"):
        backend.forward(two.q, two.k, None, two.k_cache, two.v_cache, two.meta, 0.125)


def test_only_a_fixed_output_buffer_keeps_launches_for_later_layers(monkeypatch) -> None:
    """The Triton backend hands the step's launch dict to its kernels only with a caller's output
    buffer (piecewise graphs); a fresh output per layer would never match a kept launch, and the
    dict would keep every layer's tensors alive until the step ends. Decodes beside a chunk
    share it; a decode-only batch never does."""
    import peregrine.attention.triton_backend as tb
    from step_cases import make_step
    seen = []

    def spy(name, real):
        def run(*args, launches=None, **kwargs):
            seen.append((name, launches))
            return real(*args, **kwargs)
        return run

    monkeypatch.setattr(tb, "extend_attention", spy("extend", tb.extend_attention))
    monkeypatch.setattr(tb, "paged_decode_attention", spy("decode", tb.paged_decode_attention))
    monkeypatch.setattr(tb.TritonAttentionBackend, "fold_decodes_max", 0)  # the decode kernel runs
    backend = get_attention_backend("triton")
    step = make_step(prefix_lens=[0, 30, 21, 0], q_lens=[1, 1, 13, 9], num_pad_tokens=3)
    backend.forward(step.q, step.k, step.v, step.k_cache, step.v_cache, step.meta, 0.125)
    assert seen == [("decode", None), ("extend", None)]
    seen.clear()
    backend.forward(step.q, step.k, step.v, step.k_cache, step.v_cache, step.meta, 0.125,
                    out=torch.empty_like(step.q))
    assert [name for name, _ in seen] == ["decode", "extend"]
    assert all(launches is step.meta.launches for _, launches in seen)
    seen.clear()
    decodes = make_step(prefix_lens=[30, 21], q_lens=[1, 1])
    backend.forward(decodes.q, decodes.k, decodes.v, decodes.k_cache, decodes.v_cache,
                    decodes.meta, 0.125, out=torch.empty_like(decodes.q))
    assert seen == [("decode", None)]
