"""Scheduler with speculative decoding: drafts as extra tokens, lookahead slots, rollback of
rejected drafts, trimming to the budget and the length limits, stops inside accepted tokens."""
from __future__ import annotations

from peregrine.config import CacheConfig, SchedulerConfig
from peregrine.engine.request import Request, RequestStatus
from peregrine.engine.scheduler import Scheduler
from peregrine.engine.spec_scheduling import SPEC_BACKOFF_AFTER
from peregrine.messages import ModelRunnerOutput, SchedulerOutput
from peregrine.sampling_params import SamplingParams
from peregrine.spec_decode.config import SpeculativeConfig

EOS = 2
K = 3


def make_sched(num_blocks: int = 64, block_size: int = 4, max_batched: int = 64,
               max_model_len: int = 64, k: int = K, disable: int | None = None,
               caching: bool = True) -> Scheduler:
    sc = SchedulerConfig(8, max_batched, max_model_len, True, "fcfs", None, "recompute")
    cc = CacheConfig(block_size, 0.9, 1.0, None, caching)
    spec = SpeculativeConfig("ngram", k, disable_by_batch_size=disable)
    return Scheduler(sc, cc, num_blocks, spec)


def make_req(rid: str, num_prompt: int, max_tokens: int = 20, **sp) -> Request:
    params = SamplingParams(max_tokens=max_tokens, **sp)
    return Request(rid, [100 + i for i in range(num_prompt)], params, arrival_time=0.0,
                   eos_token_ids=(EOS,), max_tokens=max_tokens)


def run(s: Scheduler, out: SchedulerOutput, tokens: dict[str, list[int]],
        drafts: dict[str, list[int]] | None = None) -> list[Request]:
    ids = list(out.num_scheduled_tokens)
    return s.update_from_output(out, ModelRunnerOutput(
        ids, [tokens.get(r, []) for r in ids], {}, {}, drafts or {}))


def prefill(s: Scheduler, req: Request, drafts: list[int]) -> SchedulerOutput:
    s.add_request(req)
    out = s.schedule()
    run(s, out, {req.request_id: [7]}, {req.request_id: drafts})
    return out


def test_prefill_holds_lookahead_slots_and_drafts_are_scheduled() -> None:
    s = make_sched()
    req = make_req("a", 6)
    out = prefill(s, req, [8, 9, 10])
    assert out.propose_drafts
    # 6 prompt tokens + K + 1 lookahead positions = 10 slots -> 3 blocks of 4
    assert len(req.block_ids) == 3
    assert req.spec_token_ids == [8, 9, 10]
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 4}
    assert out.scheduled_spec_decode_tokens == {"a": [8, 9, 10]}
    assert req.spec_token_ids == []  # consumed
    # the step computes positions 6..9 and holds K + 1 more: 14 slots -> 4 blocks
    assert len(req.block_ids) == 4


def test_rejected_drafts_roll_back_num_computed_tokens() -> None:
    s = make_sched()
    req = make_req("a", 6)
    prefill(s, req, [8, 9, 10])
    out = s.schedule()
    run(s, out, {"a": [8, 11]})  # first draft accepted, second rejected: 11 sampled instead
    assert req.output_token_ids == [7, 8, 11]
    assert req.num_computed_tokens == 8  # prompt + 7 + 8 have KV; 11 is the next input
    assert req.num_tokens == 9
    st = s.make_stats()
    assert (st.spec_num_drafts, st.spec_num_draft_tokens, st.spec_num_accepted_tokens) == (1, 3, 1)
    out = s.schedule()  # no new drafts: a plain decode of the last token
    assert out.num_scheduled_tokens == {"a": 1} and not out.scheduled_spec_decode_tokens


def test_all_accepted_gives_k_plus_one_tokens() -> None:
    s = make_sched()
    req = make_req("a", 6)
    prefill(s, req, [8, 9, 10])
    out = s.schedule()
    run(s, out, {"a": [8, 9, 10, 12]}, {"a": [13]})
    assert req.output_token_ids == [7, 8, 9, 10, 12]
    assert req.num_computed_tokens == req.num_tokens - 1 == 10
    assert req.spec_token_ids == [13]


def _hit_after(sampled: list[int]) -> int:
    """Prefix-cache hit of a prompt equal to request a's tokens after a verify step."""
    s = make_sched()
    req = make_req("a", 6)
    prefill(s, req, [8, 9, 10])
    out = s.schedule()  # computes positions 6..9 (7, then drafts 8 9 10)
    run(s, out, {"a": sampled})
    other = make_req("b", 0)
    other.prompt_token_ids = other.all_token_ids = [100, 101, 102, 103, 104, 105, 7, 8, 50]
    return s.kv.get_computed_blocks(other).num_tokens


def test_blocks_enter_the_prefix_cache_only_when_verified() -> None:
    # block 1 holds positions 4..7 = 104 105 7 8: cached only if draft 8 was accepted
    assert _hit_after([8, 20]) == 8
    assert _hit_after([20]) == 4


def test_drafts_are_trimmed_to_the_token_budget() -> None:
    s = make_sched(max_batched=6)
    a, b = make_req("a", 3), make_req("b", 3)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    run(s, out, {"a": [7], "b": [7]}, {"a": [8, 9, 10], "b": [8, 9, 10]})
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 4, "b": 2}
    assert out.scheduled_spec_decode_tokens == {"a": [8, 9, 10], "b": [8]}


def test_drafts_are_trimmed_to_max_tokens_and_max_model_len() -> None:
    s = make_sched()
    req = make_req("a", 6, max_tokens=3)
    prefill(s, req, [8, 9, 10])
    out = s.schedule()  # 1 output so far: the step may emit 2 more, so 1 draft
    assert out.scheduled_spec_decode_tokens == {"a": [8]}
    s2 = make_sched(max_model_len=9)
    req2 = make_req("b", 6)
    prefill(s2, req2, [8, 9, 10])
    out = s2.schedule()  # 7 tokens of 9: the step may emit 2, so 1 draft
    assert out.scheduled_spec_decode_tokens == {"b": [8]}
    assert len(req2.block_ids) * 4 >= 9 and len(req2.block_ids) == 3  # never past max_model_len


def test_a_stop_inside_the_accepted_tokens_cuts_the_rest() -> None:
    s = make_sched()
    req = make_req("a", 6)
    prefill(s, req, [8, EOS, 10])
    out = s.schedule()
    changed = run(s, out, {"a": [8, EOS, 10, 11]})
    assert changed == [req]
    assert req.output_token_ids == [7, 8, EOS]
    assert req.status == RequestStatus.FINISHED_STOPPED
    s2 = make_sched()
    req2 = make_req("b", 6, max_tokens=3, ignore_eos=True)
    prefill(s2, req2, [8, 9, 10])
    out = s2.schedule()
    run(s2, out, {"b": [8, 9]})
    assert req2.output_token_ids == [7, 8, 9] and req2.status == RequestStatus.FINISHED_LENGTH


def test_requests_with_penalties_get_no_drafts_or_lookahead() -> None:
    s = make_sched()
    req = make_req("a", 6, presence_penalty=0.5)
    prefill(s, req, [8, 9, 10])
    assert len(req.block_ids) == 2  # 6 prompt tokens + the next one: no lookahead
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 1} and not out.scheduled_spec_decode_tokens


def test_speculation_stands_down_above_disable_by_batch_size() -> None:
    s = make_sched(disable=1)
    a, b = make_req("a", 3), make_req("b", 3)
    for r in (a, b):
        s.add_request(r)
    out = s.schedule()
    assert out.propose_drafts  # decided with 0 running
    run(s, out, {"a": [7], "b": [7]}, {"a": [8], "b": [8]})
    out = s.schedule()
    assert not out.propose_drafts and not out.scheduled_spec_decode_tokens
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}


def test_preemption_drops_drafts() -> None:
    s = make_sched(num_blocks=5)
    a, b = make_req("a", 6, ignore_eos=True), make_req("b", 6, ignore_eos=True)
    prefill(s, a, [8, 9, 10])
    s.add_request(b)
    for _ in range(10):
        out = s.schedule()
        if "b" in out.preempted_req_ids:
            break
        run(s, out, {r: [9] for r in out.num_scheduled_tokens}, {"a": [], "b": [4, 5, 6]})
    else:
        raise AssertionError("the pool never ran out")
    assert b.status == RequestStatus.PREEMPTED and b.spec_token_ids == []
    assert "b" not in out.scheduled_spec_decode_tokens


def test_tight_pool_drops_drafts_instead_of_preempting() -> None:
    s = make_sched(num_blocks=4)
    a, b = make_req("a", 4), make_req("b", 4)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()  # lookahead does not fit for both: each still gets its prompt blocks
    run(s, out, {"a": [7], "b": [7]}, {"a": [8, 9, 10], "b": [8, 9, 10]})
    out = s.schedule()
    assert not out.preempted_req_ids
    assert sum(out.num_scheduled_tokens.values()) >= 2


def test_requests_back_off_after_drafts_are_rejected_in_a_row() -> None:
    s = make_sched()
    req = make_req("a", 6, max_tokens=50, ignore_eos=True)
    prefill(s, req, [8, 9, 10])  # step 0
    verified, proposing = [], []
    for step in range(1, 22):
        out = s.schedule()
        verified.append(bool(out.scheduled_spec_decode_tokens))
        proposing.append(out.propose_drafts)
        assert out.no_propose_req_ids in ([], ["a"])
        assert out.propose_drafts == (out.no_propose_req_ids == [])
        # every draft is rejected, except in step 17
        tokens = [8, 20] if step == 17 else [20]
        run(s, out, {"a": tokens[:1 + len(out.scheduled_spec_decode_tokens.get("a", []))]},
            {"a": [8, 9, 10]} if out.propose_drafts else {})
    T, F = True, False
    assert SPEC_BACKOFF_AFTER == 4
    # misses 1-4 (steps 1-4) -> back off until step 6 (a multiple of 2), which proposes; miss 5
    # (step 7) -> until step 8; miss 6 (step 9) -> until 16; step 17 accepts and resets; misses
    # 1-4 (steps 18-21) keep verifying
    assert verified == [T, T, T, T, F, F, T, F, T] + [F] * 7 + [T, T, T, T, T]
    assert proposing == [T, T, T, T, F, T, T, T, T] + [F] * 6 + [T, T, T, T, T, T]


def test_empty_proposals_back_off_and_back_off_steps_hold_no_lookahead() -> None:
    s = make_sched(block_size=1, max_model_len=128, num_blocks=256)
    req = make_req("a", 6, max_tokens=100, ignore_eos=True)
    prefill(s, req, [])  # step 0: the proposer found nothing, a miss
    proposing = []
    for step in range(1, 50):
        before = len(req.block_ids)
        out = s.schedule()
        proposing.append(out.propose_drafts)
        end = req.num_computed_tokens + 1  # the step's one token (no drafts ever)
        if out.propose_drafts:
            assert len(req.block_ids) == max(before, end + K + 1)
        else:  # backing off: the step's own slot only
            assert out.no_propose_req_ids == ["a"]
            assert len(req.block_ids) == max(before, end)
        run(s, out, {"a": [20]}, {})
    # empty proposals at steps 0..3 -> back off until step 4 (a multiple of 2); then until 8,
    # 16, 32 and every SPEC_EMPTY_MAX_BACKOFF = 16 steps
    assert [i for i, p in enumerate(proposing, 1) if p] == [1, 2, 3, 4, 8, 16, 32, 48]
    assert s.spec_num_drafts == 0
