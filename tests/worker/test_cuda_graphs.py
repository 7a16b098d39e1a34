"""Decode graphs' shared logits buffer, run eagerly on the CPU (capture=False): each padded size
writes only its rows of one buffer, and decode steps through it give transformers' tokens."""
from __future__ import annotations

import pytest
import torch
from worker_helpers import Step, hf_greedy, make_worker, new_req, run_steps

from peregrine.worker.cuda_graphs import CudaGraphRunner, capture_sizes, decode_graph_bytes

ARCH = "qwen3"
PROMPTS = {"a": [17, 301, 45, 99, 230, 8, 77, 150, 9, 64, 12], "b": [5, 41, 300, 7, 222, 18],
           "c": [88, 3, 140, 61, 250, 33, 9, 120, 47]}


def _runner(worker, max_batch_size: int) -> CudaGraphRunner:
    r = worker.model_runner
    return CudaGraphRunner(worker.model, r.buffers, r.kv_caches, max_batch_size,
                           worker.config.scheduler.max_model_len, capture=False)


def test_decode_graph_bytes_is_a_few_logits_buffers_not_the_sum_over_sizes() -> None:
    n, v = 1024, 128_256  # Llama-3-8B at max_num_seqs 1024
    one = n * v * 4  # (n, V) float32
    assert decode_graph_bytes(n, v, torch.bfloat16) == one + n * v * 2
    assert decode_graph_bytes(n, v, torch.float32) == 2 * one
    per_size = sum(capture_sizes(n)) * v * 4  # one logits tensor per captured size (16.3 GiB)
    assert decode_graph_bytes(n, v, torch.bfloat16) * 10 < per_size


@torch.inference_mode()
def test_each_size_writes_only_its_padded_rows_of_one_shared_buffer() -> None:
    worker = make_worker(ARCH)
    graphs = _runner(worker, 20)
    assert graphs.sizes == [1, 2, 4, 8, 16, 20]
    shared = graphs.logits  # (20, V)
    assert shared.shape == (20, worker.config.model.vocab_size) and shared.dtype == torch.float32
    buf, model = worker.model_runner.buffers, worker.model
    buf.d_input_ids[:20].copy_(torch.arange(20) * 7 + 3)  # rows differ, so a row mix-up shows
    for num_seqs, padded in [(3, 4), (17, 20), (5, 8), (1, 1)]:
        shared.fill_(float("nan"))
        out = graphs.replay(num_seqs)  # (num_seqs, V)
        assert out.shape == (num_seqs, shared.shape[1])
        assert out.data_ptr() == shared.data_ptr()
        assert not shared[:padded].isnan().any() and shared[padded:].isnan().all()
        hidden = model(buf.d_input_ids[:padded], buf.d_positions[:padded], graphs.kv_caches,
                       graphs._meta(padded))  # (padded, hidden)
        torch.testing.assert_close(shared[:padded], model.compute_logits(hidden))


def _decode_steps() -> list[Step]:
    """All three prefill, decode together (3, padded to 4) three times, then c finishes (2),
    then b (1)."""
    blocks = {rid: list(range(5 * i, 5 * i + 5)) for i, rid in enumerate(PROMPTS)}
    lens = {rid: len(p) for rid, p in PROMPTS.items()}
    steps = [Step(dict(lens), new=[new_req(rid, p, blocks[rid]) for rid, p in PROMPTS.items()])]
    for i, (running, finished) in enumerate([("abc", ""), ("abc", ""), ("abc", ""), ("ab", "c"),
                                             ("a", "b")]):
        steps.append(Step({rid: 1 for rid in running}, finished=list(finished),
                          computed={rid: lens[rid] + i for rid in running}))
    return steps


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_decode_steps_through_the_shared_buffer_give_transformers_greedy_tokens(
        async_scheduling: bool) -> None:
    worker = make_worker(ARCH)
    graphs = _runner(worker, 4)
    worker.model_runner.graphs = graphs
    replayed: list[int] = []
    replay = graphs.replay
    graphs.replay = lambda n: (replayed.append(n), replay(n))[1]
    outs = run_steps(worker, _decode_steps(), async_scheduling)
    assert replayed == [3, 3, 3, 2, 1]
    got: dict[str, list[int]] = {rid: [] for rid in PROMPTS}
    for out in outs:
        for rid, toks in zip(out.req_ids, out.sampled_token_ids):
            got[rid] += toks
    for rid, n in {"a": 6, "b": 5, "c": 4}.items():
        assert got[rid] == hf_greedy(ARCH, tuple(PROMPTS[rid]), n)[0], rid


@pytest.mark.parametrize("max_batch_size,padded", [(4, 4), (2, None)], ids=["padded", "too-many-rows"])
@torch.inference_mode()
def test_a_prefill_step_computes_its_logits_in_the_shared_buffer_at_a_graph_size(
        max_batch_size: int, padded: int | None) -> None:
    """Three prompts' rows are padded to the decode graphs' size 4 (the last row repeated) and
    written into their shared buffer; with a largest size of 2 they are computed apart. Either
    way the sampled tokens are transformers' first greedy tokens."""
    worker = make_worker(ARCH)
    graphs = _runner(worker, max_batch_size)
    worker.model_runner.graphs = graphs
    graphs.logits.fill_(float("nan"))
    out = run_steps(worker, _decode_steps()[:1], async_scheduling=False)[0]
    got = dict(zip(out.req_ids, out.sampled_token_ids))
    for rid, prompt in PROMPTS.items():
        assert got[rid] == hf_greedy(ARCH, tuple(prompt), 1)[0], rid
    if padded is None:
        assert graphs.logits.isnan().all()
    else:
        rows = graphs.logits[:padded]
        assert not rows.isnan().any()
        torch.testing.assert_close(rows[3], rows[2])  # the repeated last row
        assert (rows[:3].argmax(-1).tolist() ==
                [hf_greedy(ARCH, tuple(p), 1)[0][0] for p in PROMPTS.values()])


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@torch.inference_mode()
def test_a_prompt_in_chunks_with_graphs_samples_only_after_its_last_chunk(
        async_scheduling: bool) -> None:
    """The first chunks sample no row (no logits rows at all); the last one samples
    transformers' first greedy token, its row computed in the shared buffer."""
    worker = make_worker(ARCH)
    worker.model_runner.graphs = _runner(worker, 4)
    prompt = PROMPTS["a"]  # 11 tokens: chunks of 4, 4 and 3
    blocks = list(range(5))
    steps = [Step({"a": 4}, new=[new_req("a", prompt, blocks)]),
             Step({"a": 4}, computed={"a": 4}), Step({"a": 3}, computed={"a": 8})]
    outs = run_steps(worker, steps, async_scheduling)
    sampled = [dict(zip(o.req_ids, o.sampled_token_ids)).get("a", []) for o in outs]
    assert sampled[:2] == [[], []]
    assert sampled[2] == hf_greedy(ARCH, tuple(prompt), 1)[0]
