"""DraftModelProposer alone on the CPU: its drafts are the draft model's greedy tokens
(transformers as the oracle) across calls, chunked catch-up, removals and scattered blocks."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from peregrine.config import EngineArgs
from peregrine.spec_decode import ProposeInput
from peregrine.spec_decode.draft_model import DraftModelProposer
from peregrine.testing.checkpoints import tiny_checkpoint
from peregrine.worker.cuda_graphs import CudaGraphRunner, PiecewiseGraphs

BLOCK = 4
NUM_BLOCKS = 96
K = 3
# A smaller model of the tiny checkpoints' vocabulary and tokenizer, with weights of its own.
DRAFT_KW = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                num_key_value_heads=1, seed=7)


def target_path() -> str:
    return str(tiny_checkpoint("llama"))


def draft_path() -> str:
    return str(tiny_checkpoint("llama", **DRAFT_KW))


def make_proposer(spec: dict | None = None, **engine: object) -> DraftModelProposer:
    args = dict(model=target_path(), dtype="float32", device="cpu", max_model_len=128,
                block_size=BLOCK, num_gpu_blocks_override=NUM_BLOCKS, seed=0,
                speculative_config={"model": draft_path(), "num_speculative_tokens": K,
                                    **(spec or {})})
    cfg = EngineArgs(**{**args, **engine}).create_engine_config()
    proposer = DraftModelProposer(cfg, cfg.speculative, torch.device("cpu"))
    proposer.load_model(None)
    proposer.initialize_kv_cache(NUM_BLOCKS)
    return proposer


@pytest.fixture(scope="module")
def hf_draft():
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(draft_path(), dtype=torch.float32).eval()


def hf_greedy(model, tokens: np.ndarray, n: int) -> list[int]:
    """n greedy tokens of transformers' model after `tokens` (full recompute each step)."""
    ids = torch.tensor([tokens.tolist()])
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(ids).logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


class Requests:
    """Requests with scattered (shuffled, disjoint) block ids and their tokens."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.free = list(self.rng.permutation(NUM_BLOCKS))
        self.tokens: dict[str, np.ndarray] = {}
        self.blocks: dict[str, np.ndarray] = {}

    def add(self, rid: str, prompt_len: int) -> None:
        self.tokens[rid] = self.rng.integers(5, 500, prompt_len).astype(np.int32)
        self.blocks[rid] = np.zeros(0, np.int32)
        self._grow(rid)

    def append(self, rid: str, toks: list[int]) -> None:
        self.tokens[rid] = np.concatenate([self.tokens[rid], np.asarray(toks, np.int32)])
        self._grow(rid)

    def _grow(self, rid: str) -> None:
        need = -(-(len(self.tokens[rid]) + K) // BLOCK)
        extra = [self.free.pop() for _ in range(need - len(self.blocks[rid]))]
        self.blocks[rid] = np.concatenate([self.blocks[rid], np.asarray(extra, np.int32)])

    def release(self, rid: str) -> None:
        self.free += self.blocks.pop(rid).tolist()
        del self.tokens[rid]

    def input(self, num_draft: dict[str, int]) -> ProposeInput:
        ids = list(num_draft)
        return ProposeInput(ids, [self.tokens[r] for r in ids], [self.blocks[r] for r in ids],
                            np.array([num_draft[r] for r in ids]))


def check(proposer, reqs: Requests, hf, num_draft: dict[str, int]) -> dict[str, list[int]]:
    drafts = proposer.propose(reqs.input(num_draft))
    got = dict(zip(num_draft, drafts))
    want = {r: hf_greedy(hf, reqs.tokens[r], num_draft[r]) for r in num_draft}
    assert got == want
    return got


def count_fed_tokens(proposer) -> list[int]:
    """Tokens of every draft forward from now on."""
    fed: list[int] = []
    proposer.model.register_forward_pre_hook(lambda m, args: fed.append(int(args[0].shape[0])))
    return fed


def test_drafts_are_the_draft_models_greedy_tokens_across_calls(hf_draft):
    # NOTE: a 10-token budget splits the 31- and 17-token prompts over several forwards.
    proposer = make_proposer(max_num_batched_tokens=10)
    reqs = Requests()
    for rid, n in (("a", 5), ("b", 17), ("c", 31)):
        reqs.add(rid, n)
    fed = count_fed_tokens(proposer)
    d1 = check(proposer, reqs, hf_draft, {"a": 3, "b": 3, "c": 3})
    assert max(fed) <= 10 and sum(fed[:-2]) == 5 + 17 + 31  # catch-up, then 2 decode passes
    # a accepts every draft and a bonus token, b one draft then another token, c none.
    reqs.append("a", d1["a"] + [11])
    reqs.append("b", [d1["b"][0], (d1["b"][1] + 1) % 500])
    reqs.append("c", [(d1["c"][0] + 1) % 500])
    fed.clear()
    check(proposer, reqs, hf_draft, {"a": 3, "b": 3, "c": 1})
    # Fed drafts that were accepted stay in the cache; the first rejected one is overwritten:
    # a feeds 2 (its third draft was never fed, then the bonus), b and c their new token.
    assert fed[0] == 2 + 1 + 1
    # A request that gets no drafts for a while catches up later.
    reqs.append("a", [7, 8])
    check(proposer, reqs, hf_draft, {"a": 0, "b": 2})
    reqs.append("a", [9])
    check(proposer, reqs, hf_draft, {"c": 3, "a": 2})


def test_removed_request_starts_over(hf_draft):
    proposer = make_proposer()
    reqs = Requests(seed=1)
    reqs.add("x", 9)
    reqs.add("y", 6)
    check(proposer, reqs, hf_draft, {"x": 3, "y": 3})
    # x is preempted and comes back under the same id with other tokens in other blocks.
    proposer.remove_requests(["x", "never-seen"])
    reqs.release("x")
    reqs.add("x", 13)
    fed = count_fed_tokens(proposer)
    check(proposer, reqs, hf_draft, {"x": 3, "y": 1})
    assert fed[0] == 13 + 1  # x from scratch, y its last token again


def test_drafts_write_only_their_requests_blocks(hf_draft):
    proposer = make_proposer()
    reqs = Requests(seed=2)
    reqs.add("p", 10)
    reqs.add("q", 3)
    check(proposer, reqs, hf_draft, {"p": 3, "q": 2})
    used = np.concatenate(list(reqs.blocks.values()))
    unused = np.setdiff1d(np.arange(NUM_BLOCKS), used)
    for k_cache, v_cache in proposer.kv_caches:
        assert not k_cache[unused].any() and not v_cache[unused].any()
        assert k_cache[used].any()


def test_kv_bytes_per_block_are_the_drafts():
    proposer = make_proposer()
    # draft: 1 layer x K and V x 4 tokens x 1 kv head x head dim 16 x 4 bytes
    assert proposer.kv_cache_bytes_per_block() == 1 * 2 * BLOCK * 1 * 16 * 4
    assert proposer.kv_caches[0][0].shape == (NUM_BLOCKS, BLOCK, 1, 16)
    fp8 = make_proposer(kv_cache_dtype="fp8")
    assert fp8.kv_cache_bytes_per_block() == 1 * 2 * BLOCK * 1 * 16 * 1
    assert fp8.kv_caches[0][0].dtype == torch.float8_e4m3fn


def test_no_drafts_wanted_runs_nothing():
    proposer = make_proposer()
    reqs = Requests(seed=3)
    reqs.add("a", 4)
    fed = count_fed_tokens(proposer)
    assert proposer.propose(reqs.input({"a": 0})) == [[]]
    assert proposer.propose(ProposeInput([], [], [], np.zeros(0, np.int64))) == []
    assert fed == []


def test_drafts_stop_at_the_drafts_last_position(hf_draft):
    # A draft of 40 positions: a fed draft must sit below position 40.
    short = str(tiny_checkpoint("llama", max_position_embeddings=40, **DRAFT_KW))
    proposer = make_proposer(spec={"model": short}, max_model_len=40)
    reqs = Requests(seed=4)
    reqs.add("a", 39)
    reqs.add("b", 37)
    drafts = proposer.propose(reqs.input({"a": 3, "b": 3}))
    assert [len(x) for x in drafts] == [2, 3]


def test_bad_input_is_refused():
    proposer = make_proposer()
    reqs = Requests(seed=5)
    reqs.add("a", 8)
    with pytest.raises(ValueError, match=r"num_draft must be in \[0, 3\]"):
        proposer.propose(reqs.input({"a": 4}))
    short = reqs.input({"a": 3})
    short.block_ids[0] = short.block_ids[0][:2]
    with pytest.raises(ValueError, match="'a': its drafts need 3 KV blocks, its block table "
                                         "has 2"):
        proposer.propose(short)
    bad = reqs.input({"a": 3})
    bad.num_draft = np.array([1, 1])
    with pytest.raises(ValueError, match="1 req_ids, 1 token_ids, 1 block_ids, 2 num_draft"):
        proposer.propose(bad)


def test_a_draft_of_another_vocabulary_is_refused():
    other = str(tiny_checkpoint("llama", with_tokenizer=False, vocab_size=256, seed=3))
    with pytest.raises(ValueError, match="vocab_size 256 differs from the target's 512"):
        make_proposer(spec={"model": other})


def test_a_draft_shorter_than_max_model_len_is_refused():
    short = str(tiny_checkpoint("llama", max_position_embeddings=64, **DRAFT_KW))
    with pytest.raises(ValueError, match="max_model_len: 128 exceeds the model's limit 64"):
        make_proposer(spec={"model": short})


@pytest.mark.parametrize("max_num_seqs", [1, 256])
def test_warm_up_writes_no_kv(hf_draft, max_num_seqs):
    proposer = make_proposer(max_num_seqs=max_num_seqs)
    proposer._warm_up()  # run on CUDA before the graphs are captured
    assert not any(k.any() or v.any() for k, v in proposer.kv_caches)
    reqs = Requests(seed=6)
    reqs.add("a", 6)
    check(proposer, reqs, hf_draft, {"a": 3})


def test_decode_graph_path_gives_the_same_drafts(hf_draft):
    # NOTE: capture=False runs the graphs' exact steps eagerly: padded batches over the fixed
    # step buffers, the drafts written into the input-id buffer on the device.
    proposer = make_proposer(max_num_seqs=6)
    proposer.graphs = CudaGraphRunner(proposer.model, proposer.buffers, proposer.kv_caches,
                                      proposer.max_num_reqs, proposer.max_positions,
                                      capture=False)
    replays: list[int] = []
    replay = proposer.graphs.replay
    proposer.graphs.replay = lambda b: replays.append(b) or replay(b)
    reqs = Requests(seed=7)
    for rid, n in (("a", 7), ("b", 12), ("c", 2)):
        reqs.add(rid, n)
    d = check(proposer, reqs, hf_draft, {"a": 3, "b": 3, "c": 2})
    assert replays == [3, 2]  # the catch-up is a prefill: eager; then two decode passes
    for rid in "abc":
        reqs.append(rid, d[rid][:1] + [9])
    check(proposer, reqs, hf_draft, {"a": 3, "b": 1, "c": 3})
    assert replays[2:] == [3, 2, 2]  # an all-decode catch-up replays too


def test_graph_memory_is_reserved_only_where_graphs_are_captured():
    import dataclasses

    from peregrine.worker.cuda_graphs import decode_graph_bytes
    proposer = make_proposer(max_num_seqs=8)
    assert not proposer.captures_graphs() and proposer.graph_memory_bytes() == 0
    proposer.device = torch.device("cuda")  # what the sizing would see on a GPU
    proposer.engine_config = dataclasses.replace(proposer.engine_config,
                                                 attention_backend="triton")
    assert proposer.graph_memory_bytes() == decode_graph_bytes(8, 512, torch.float32)
    proposer.engine_config = dataclasses.replace(proposer.engine_config, enforce_eager=True)
    assert proposer.graph_memory_bytes() == 0


def test_piecewise_graph_path_gives_the_same_drafts(hf_draft):
    # NOTE: capture=False runs the pieces eagerly over the fixed buffers, padded to a size.
    proposer = make_proposer(max_num_batched_tokens=16)
    proposer.prefill_graphs = PiecewiseGraphs(proposer.model, proposer.buffers,
                                              proposer.kv_caches, [8, 16], capture=False)
    runs: list[int] = []
    run = proposer.prefill_graphs.run
    proposer.prefill_graphs.run = lambda t, meta: runs.append(t) or run(t, meta)
    reqs = Requests(seed=8)
    for rid, n in (("a", 5), ("b", 14)):
        reqs.add(rid, n)
    d = check(proposer, reqs, hf_draft, {"a": 3, "b": 2})
    reqs.append("a", d["a"] + [3])
    reqs.append("b", [4])
    check(proposer, reqs, hf_draft, {"a": 2, "b": 3})
    # 19 prompt tokens in passes of 16 and 3, decodes of 2 and 1 requests (no decode graphs
    # here); then a's 2 new tokens beside b's 1, decodes again.
    assert runs == [16, 3, 2, 1, 3, 2, 1]
