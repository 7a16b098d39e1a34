"""Decode CUDA graphs share one logits buffer and one memory pool.

Through the public LLM API (async scheduling, the default on CUDA): batches of 3, 17, 5, 33 and
250 requests with staggered lengths walk the decode batch through many captured sizes in turn,
and the greedy tokens equal the eager engine's, with and without piecewise graphs (which capture
into the same pool); the decode graphs keep about two logits buffers of the largest size
(decode_graph_bytes), not one per captured size.
"""
from __future__ import annotations

import gc
from typing import NamedTuple

import pytest
import torch

from peregrine import LLM, SamplingParams
from peregrine.testing.checkpoints import build_tiny_checkpoint
from peregrine.worker.cuda_graphs import capture_sizes, decode_graph_bytes

pytestmark = pytest.mark.gpu

VOCAB = 65_536  # large, so that logits are most of the graphs' memory
MAX_SEQS = 256
BATCHES = [3, 17, 5, 33, 250]
# Activations of the largest decode batch, cuBLAS workspaces, the pool's 2 MiB rounding.
MARGIN = 64 << 20


class Run(NamedTuple):
    tokens: list[list[list[int]]]  # per batch, per request
    reserved: int  # torch's reserved GPU memory with the engine built and its caches emptied
    replayed: list[int]  # padded sizes of the decode graph replays, in order
    shared_ptrs: set[int]  # data_ptr of every replay's logits
    shared_shape: tuple[int, ...] | None  # the shared logits buffer's shape
    shared_ptr: int | None  # and its data_ptr
    graph_bytes: int  # CudaGraphRunner.memory_bytes
    shares_pool: bool  # the piecewise graphs capture into the decode graphs' pool


def _batch(k: int, size: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts of 4..32 tokens; max_tokens from 2 to 24, so requests finish one by one."""
    g = torch.Generator().manual_seed(k)
    prompts = [torch.randint(5, 500, (4 + (7 * j) % 29,), generator=g).tolist()
               for j in range(size)]
    params = [SamplingParams(temperature=0.0, max_tokens=2 + (5 * j + k) % 23, ignore_eos=True)
              for j in range(size)]
    return prompts, params


def _run(path: str, **engine_args) -> Run:
    graphs = None
    llm = LLM(path, dtype="float32", attention_backend="triton", max_model_len=512,
              max_num_seqs=MAX_SEQS, num_gpu_blocks_override=2048, engine_core_process=False,
              **engine_args)
    try:
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        reserved = torch.cuda.memory_reserved()
        graphs = llm.engine.core_client.core.executor.worker.model_runner.graphs
        replayed: list[int] = []
        ptrs: set[int] = set()
        if graphs is not None:
            replay = graphs.replay

            def recording_replay(n: int) -> torch.Tensor:
                out = replay(n)  # (n, V)
                replayed.append(graphs.padded(n))
                ptrs.add(out.data_ptr())
                return out

            graphs.replay = recording_replay
        tokens = []
        for k, size in enumerate(BATCHES):
            outs = llm.generate(*_batch(k, size), use_tqdm=False)
            tokens.append([list(o.outputs[0].token_ids) for o in outs])
        if graphs is None:
            return Run(tokens, reserved, replayed, ptrs, None, None, 0, False)
        pieces = llm.engine.core_client.core.executor.worker.model_runner.prefill_graphs
        return Run(tokens, reserved, replayed, ptrs, tuple(graphs.logits.shape),
                   graphs.logits.data_ptr(), graphs.memory_bytes,
                   pieces is not None and pieces.pool == graphs.pool)
    finally:
        graphs = None  # NOTE: breaks the replay wrapper's cycle, so the graphs go with the engine
        del llm
        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, Run, Run]:
    """(eager, decode graphs only, decode and piecewise graphs) on one fp32 checkpoint with a
    65,536-token vocabulary."""
    root = tmp_path_factory.mktemp("gpu-graph-memory")
    path = str(build_tiny_checkpoint(root, "qwen3", dtype=torch.float32, vocab_size=VOCAB,
                                     hidden_size=256, head_dim=64, num_attention_heads=4,
                                     num_key_value_heads=2, intermediate_size=512,
                                     num_hidden_layers=2, max_position_embeddings=512))
    # NOTE: no piecewise graphs, so the graph engine's extra memory is the decode graphs'.
    eager = _run(path, enforce_eager=True)
    graphs = _run(path, max_prefill_graph_tokens=0)
    return eager, graphs, _run(path)


@pytest.mark.parametrize("which", [1, 2], ids=["decode_graphs", "decode_and_piecewise_graphs"])
def test_graph_greedy_tokens_equal_eager_across_batch_sizes(runs, which: int) -> None:
    eager, graphs = runs[0], runs[which]
    assert [len(t) for t in graphs.tokens] == BATCHES
    assert graphs.tokens == eager.tokens


def test_piecewise_graphs_share_the_decode_graphs_pool(runs) -> None:
    assert runs[2].shares_pool and not runs[1].shares_pool


def test_replays_walk_many_sizes_and_all_write_the_shared_buffer(runs) -> None:
    graphs = runs[1]
    sizes = set(graphs.replayed)
    assert {1, 2, 4, 8, 16, 32, 48, MAX_SEQS} <= sizes, sorted(sizes)
    # Consecutive replays change size both ways (a new batch grows it, finished requests shrink it).
    pairs = list(zip(graphs.replayed, graphs.replayed[1:]))
    assert any(a > b for a, b in pairs) and any(a < b for a, b in pairs)
    assert graphs.shared_shape == (MAX_SEQS, VOCAB)
    assert graphs.shared_ptrs == {graphs.shared_ptr}


def test_graphs_keep_about_two_largest_logits_buffers_not_one_per_size(runs) -> None:
    eager, graphs = runs[0], runs[1]
    estimate = decode_graph_bytes(MAX_SEQS, VOCAB, torch.float32)  # 2 x (256, V) float32
    per_size = sum(capture_sizes(MAX_SEQS)) * VOCAB * 4  # the old layout: 548 MiB
    assert estimate + MARGIN < per_size / 2
    assert 0 < graphs.graph_bytes <= estimate + MARGIN, graphs.graph_bytes / 2**20
    # The same, measured from outside: the graph engine's memory over the eager engine's.
    assert graphs.reserved - eager.reserved <= estimate + MARGIN, \
        (graphs.reserved - eager.reserved) / 2**20
