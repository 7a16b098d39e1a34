"""Scheduler: exact batches, chunking, preemption order, errors, aborts, forks, stop checks.

A fake "model" drives it: schedule(), then update_from_output with made-up token ids.
"""
from __future__ import annotations

import random

import pytest

from peregrine.config import CacheConfig, SchedulerConfig
from peregrine.engine.request import Request, RequestStatus
from peregrine.engine.scheduler import Scheduler
from peregrine.kv_cache.swap_cost import DeviceCosts, SwapCostModel
from peregrine.messages import ModelRunnerOutput, SchedulerOutput
from peregrine.sampling_params import SamplingParams

EOS = 2
TOKEN = 5  # what the fake model samples unless told otherwise


def make_sched(num_blocks: int = 64, block_size: int = 16, max_num_seqs: int = 8,
               max_batched: int = 64, max_model_len: int = 256, chunked: bool = True,
               policy: str = "fcfs", caching: bool = True,
               max_queue_len: int | None = None, num_cpu_blocks: int = 0,
               preemption_mode: str = "auto", swap_cost: SwapCostModel | None = None) -> Scheduler:
    sc = SchedulerConfig(max_num_seqs, max_batched, max_model_len, chunked, policy, max_queue_len,
                         preemption_mode, swap_cost)
    cc = CacheConfig(block_size, 0.9, 1.0, None, caching, num_cpu_blocks=num_cpu_blocks)
    return Scheduler(sc, cc, num_blocks)


def make_req(rid: str, num_prompt: int, max_tokens: int = 4, base: int = 1000,
             arrival: float = 0.0, priority: int = 0, fork_source: Request | None = None,
             **sp) -> Request:
    params = SamplingParams(max_tokens=max_tokens, **sp)
    return Request(rid, [base + i for i in range(num_prompt)], params, arrival_time=arrival,
                   priority=priority, eos_token_ids=(EOS,), max_tokens=max_tokens,
                   fork_source=fork_source)


def result(out: SchedulerOutput, sampled: list[list[int]]) -> ModelRunnerOutput:
    """What a model would return for `out`: these token lists, in the step's order."""
    return ModelRunnerOutput(list(out.num_scheduled_tokens), sampled, {}, {})


def step(s: Scheduler, token: int = TOKEN) -> SchedulerOutput:
    """One fake model step: a token is sampled for every request whose known tokens are done."""
    out = s.schedule()
    sampled = [[token] if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] ==
               r.num_tokens else [] for r in s.requests_of(out)]
    s.update_from_output(out, result(out, sampled))
    return out


def batch(out: SchedulerOutput) -> list[tuple[str, int]]:
    return list(out.num_scheduled_tokens.items())


def held_blocks(s: Scheduler) -> int:
    return s.kv.num_blocks - s.kv.num_free_blocks


# ---- batching and chunked prefill ----------------------------------------------------------------

def test_chunked_prefill_splits_prompt_by_budget():
    s = make_sched(max_batched=16)
    a = make_req("a", 40)
    s.add_request(a)
    assert [batch(step(s)) for _ in range(4)] == [[("a", 16)], [("a", 16)], [("a", 8)], [("a", 1)]]
    assert a.output_token_ids == [TOKEN, TOKEN]


def test_unfinished_prefill_chunk_samples_no_token():
    s = make_sched(max_batched=16)
    a = make_req("a", 40)
    s.add_request(a)
    out = s.schedule()
    assert s.update_from_output(out, result(out, [[]])) == []
    assert a.num_computed_tokens == 16 and a.output_token_ids == []


def test_decodes_scheduled_before_new_prefills():
    s = make_sched(max_batched=16)
    s.add_request(make_req("a", 10, base=0))
    step(s)
    s.add_request(make_req("b", 40, base=500))
    out = step(s)
    assert batch(out) == [("a", 1), ("b", 15)]
    assert out.total_num_scheduled_tokens == 16


def test_max_num_seqs_respected():
    s = make_sched(max_num_seqs=2)
    for i in range(3):
        s.add_request(make_req(f"r{i}", 4, max_tokens=2, base=100 * i))
    assert batch(step(s)) == [("r0", 4), ("r1", 4)]
    assert s.num_running == 2 and s.num_waiting == 1
    assert batch(step(s)) == [("r0", 1), ("r1", 1)]  # both finish (max_tokens=2)
    assert batch(step(s)) == [("r2", 4)]


def test_chunked_prefill_off_admits_only_whole_prompts():
    s = make_sched(max_batched=32, chunked=False)
    for rid, n, base in (("a", 20, 0), ("b", 20, 100), ("c", 5, 200)):
        s.add_request(make_req(rid, n, base=base))
    assert batch(step(s)) == [("a", 20)]  # b does not fit the remaining 12: c waits behind it
    assert batch(step(s)) == [("a", 1), ("b", 20), ("c", 5)]


def test_prompt_clipped_to_max_model_len_finishes_with_length():
    s = make_sched(max_model_len=8, max_batched=64)
    a = make_req("a", 8, max_tokens=4)
    s.add_request(a)
    assert batch(step(s)) == [("a", 8)]
    assert a.status == RequestStatus.FINISHED_LENGTH and a.num_tokens == 9


# ---- preemption -----------------------------------------------------------------------------------

def _three_full_requests(policy: str) -> tuple[Scheduler, list[Request]]:
    """6 blocks of 4; three 8-token prompts fill the pool; each decode then needs a new block."""
    s = make_sched(num_blocks=6, block_size=4, max_batched=64, policy=policy)
    reqs = [make_req(rid, 8, max_tokens=8, base=100 * i) for i, rid in enumerate("abc")]
    for r in reqs:
        s.add_request(r)
    step(s)
    assert s.kv.num_free_blocks == 0
    return s, reqs


def test_fcfs_preempts_most_recently_admitted():
    s, (a, b, c) = _three_full_requests("fcfs")
    out = step(s)
    assert batch(out) == [("a", 1), ("b", 1)]
    assert out.preempted_req_ids == ["c"]
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert c.block_ids == [] and c.num_preemptions == 1
    assert s.make_stats().num_preemptions == 1


def test_fcfs_preempted_request_goes_to_front_of_waiting():
    s, (a, b, c) = _three_full_requests("fcfs")
    d = make_req("d", 4, base=900)
    s.add_request(d)
    step(s)
    assert [r.request_id for r in s.waiting] == ["c", "d"]


def test_no_admission_in_a_step_that_preempted():
    s, _ = _three_full_requests("fcfs")
    s.add_request(make_req("d", 1, base=900))
    out = step(s)
    assert "d" not in out.num_scheduled_tokens


def test_priority_preempts_largest_priority_even_itself():
    s = make_sched(num_blocks=6, block_size=4, policy="priority")
    x = make_req("x", 7, max_tokens=8, base=0, priority=1, arrival=0.0)
    s.add_request(x)
    step(s)  # x: 8 tokens in 2 blocks
    s.add_request(make_req("y", 8, max_tokens=8, base=100, arrival=1.0))
    s.add_request(make_req("z", 8, max_tokens=8, base=200, arrival=2.0))
    assert batch(step(s)) == [("x", 1), ("y", 8), ("z", 8)]
    out = step(s)  # x needs a 3rd block and is itself the lowest-priority victim
    assert out.preempted_req_ids == ["x"]
    assert batch(out) == [("y", 1), ("z", 1)]


def test_priority_victim_already_scheduled_gives_back_its_tokens():
    s = make_sched(num_blocks=4, block_size=4, policy="priority")
    x = make_req("x", 6, max_tokens=8, base=0, priority=1)
    s.add_request(x)
    step(s)
    s.add_request(make_req("y", 8, max_tokens=8, base=100, arrival=1.0))
    step(s)
    out = step(s)  # x's decode fits its block, y's needs one: x is dropped from the batch
    assert batch(out) == [("y", 1)] and out.total_num_scheduled_tokens == 1
    assert out.preempted_req_ids == ["x"]


def test_priority_ties_preempt_latest_arrival():
    s = make_sched(num_blocks=6, block_size=4, policy="priority")
    for i, rid in enumerate("abc"):
        s.add_request(make_req(rid, 8, max_tokens=8, base=100 * i, arrival=float(i)))
    step(s)
    assert step(s).preempted_req_ids == ["c"]


def test_preempted_request_resumes_and_finishes():
    s, reqs = _three_full_requests("fcfs")
    for _ in range(40):
        if not s.has_unfinished_requests():
            break
        step(s)
    assert all(r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 8 for r in reqs)
    assert held_blocks(s) == 0


# ---- requests that can never fit --------------------------------------------------------------------

def test_never_fitting_request_errors_and_others_continue():
    s = make_sched(num_blocks=4, block_size=4)
    big, small = make_req("big", 16, base=0), make_req("small", 4, base=100)
    s.add_request(big)
    s.add_request(small)
    out = s.schedule()
    assert batch(out) == [("small", 4)]
    assert out.finished_req_ids == ["big"]
    assert big.status == RequestStatus.FINISHED_ERROR
    assert big.error is not None and "5 KV cache blocks (17 tokens)" in big.error
    assert "only 4 blocks" in big.error
    assert big in s.update_from_output(out, result(out, [[TOKEN]]))
    assert s.get_request("big") is None and small.num_output_tokens == 1


def test_running_request_alone_out_of_blocks_errors():
    s = make_sched(num_blocks=2, block_size=4)
    a = make_req("a", 4, max_tokens=20)
    s.add_request(a)
    for _ in range(5):
        step(s)  # prefill + 4 decodes: 8 tokens computed, 9 known
    assert a.status == RequestStatus.RUNNING and a.num_computed_tokens == 8
    out = s.schedule()
    assert out.num_scheduled_tokens == {} and out.finished_req_ids == ["a"]
    assert a.status == RequestStatus.FINISHED_ERROR and "3 KV cache blocks" in (a.error or "")
    assert s.update_from_output(out, result(out, [])) == [a]
    assert held_blocks(s) == 0


# ---- aborts ---------------------------------------------------------------------------------------------

def test_abort_waiting_request():
    s = make_sched()
    a = make_req("a", 4)
    s.add_request(a)
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert a.status == RequestStatus.FINISHED_ABORTED and s.num_waiting == 0
    assert not s.has_unfinished_requests()
    assert s.schedule().finished_req_ids == ["a"]


def test_abort_running_request_frees_blocks():
    s = make_sched()
    a = make_req("a", 40)
    s.add_request(a)
    step(s)
    assert held_blocks(s) == 3
    s.finish_requests(["a", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert held_blocks(s) == 0 and a.block_ids == [] and s.num_running == 0


def test_abort_between_schedule_and_update():
    s = make_sched()
    a, b = make_req("a", 20, base=0), make_req("b", 20, base=100)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    changed = s.update_from_output(out, result(out, [[TOKEN], [TOKEN]]))
    assert changed == [b]
    assert a.num_computed_tokens == 0 and a.output_token_ids == [] and a.block_ids == []
    assert held_blocks(s) == 2


def test_abort_preempted_request():
    s, (a, b, c) = _three_full_requests("fcfs")
    step(s)
    assert c.status == RequestStatus.PREEMPTED
    s.finish_requests("c", RequestStatus.FINISHED_ABORTED)
    assert s.num_waiting == 0 and c.status == RequestStatus.FINISHED_ABORTED


def test_finish_with_unfinished_status_rejected():
    s = make_sched()
    with pytest.raises(ValueError, match="not a finished status"):
        s.finish_requests("a", RequestStatus.RUNNING)


# ---- forks (n > 1) -----------------------------------------------------------------------------------

@pytest.mark.parametrize("caching", [True, False])
def test_fork_waits_for_source_then_shares_blocks(caching):
    s = make_sched(max_batched=16, caching=caching)
    src = make_req("p#0", 40)
    child = make_req("p#1", 40, fork_source=src)
    s.add_request(src)
    s.add_request(child)
    assert batch(step(s)) == [("p#0", 16)]
    assert batch(step(s)) == [("p#0", 16)]  # 32 computed: now the child may share 2 blocks
    out = step(s)
    assert batch(out) == [("p#0", 8), ("p#1", 8)]
    assert child.block_ids[:2] == src.block_ids[:2] and child.block_ids[2] != src.block_ids[2]
    assert [s.kv.pool.blocks[i].ref_cnt for i in src.block_ids] == [2, 2, 1]
    assert child.num_cached_tokens == 32
    assert s.make_stats().prefix_cache_hits == 0  # sharing by fork is not a cache hit


def test_fork_proceeds_alone_when_source_aborted():
    s = make_sched(max_batched=16, caching=False)
    src = make_req("p#0", 40)
    child = make_req("p#1", 40, fork_source=src)
    s.add_request(src)
    s.add_request(child)
    step(s)
    s.finish_requests("p#0", RequestStatus.FINISHED_ABORTED)
    assert batch(step(s)) == [("p#1", 16)]
    assert child.num_cached_tokens == 0


def test_fork_short_prompt_needs_no_wait():
    s = make_sched()
    src = make_req("p#0", 10)
    child = make_req("p#1", 10, fork_source=src)
    s.add_request(src)
    s.add_request(child)
    assert batch(step(s)) == [("p#0", 10), ("p#1", 10)]


# ---- queue and priority ----------------------------------------------------------------------------------

def test_duplicate_request_id_rejected():
    s = make_sched()
    s.add_request(make_req("a", 4))
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(make_req("a", 4))


def test_priority_order_with_ties_by_arrival():
    s = make_sched(max_num_seqs=1, policy="priority")
    s.add_request(make_req("low", 4, max_tokens=1, priority=1, arrival=0.0, base=0))
    s.add_request(make_req("late", 4, max_tokens=1, priority=0, arrival=2.0, base=100))
    s.add_request(make_req("early", 4, max_tokens=1, priority=0, arrival=1.0, base=200))
    assert [r.request_id for r in s.waiting] == ["early", "late", "low"]
    assert [batch(step(s)) for _ in range(3)] == [[("early", 4)], [("late", 4)], [("low", 4)]]


def test_fcfs_ignores_priority():
    s = make_sched(max_num_seqs=1)
    s.add_request(make_req("a", 4, max_tokens=1, priority=5, base=0))
    s.add_request(make_req("b", 4, max_tokens=1, priority=0, base=100))
    assert batch(step(s)) == [("a", 4)]


# ---- stop checks -----------------------------------------------------------------------------------------

def _run_one(req: Request, tokens: list[int], max_model_len: int = 256) -> Request:
    s = make_sched(max_model_len=max_model_len)
    s.add_request(req)
    for tok in tokens:
        if req.is_finished:
            break
        step(s, tok)
    return req


def test_eos_stops_with_no_stop_reason():
    r = _run_one(make_req("a", 4, max_tokens=8), [7, EOS, 7])
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason is None
    assert r.output_token_ids == [7, EOS]


def test_min_tokens_suppresses_eos():
    r = _run_one(make_req("a", 4, max_tokens=8, min_tokens=2), [EOS, EOS])
    assert r.status == RequestStatus.FINISHED_STOPPED and r.output_token_ids == [EOS, EOS]


def test_ignore_eos_runs_to_max_tokens():
    r = _run_one(make_req("a", 4, max_tokens=3, ignore_eos=True), [EOS] * 5)
    assert r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 3


def test_stop_token_id_sets_stop_reason():
    r = _run_one(make_req("a", 4, max_tokens=8, stop_token_ids=[42]), [7, 42])
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason == 42


def test_max_model_len_finishes_with_length():
    r = _run_one(make_req("a", 6, max_tokens=100), [7] * 10, max_model_len=8)
    assert r.status == RequestStatus.FINISHED_LENGTH and r.num_tokens == 8


# ---- prefix caching and bookkeeping ---------------------------------------------------------------------

def test_prefix_hit_through_scheduler_in_tokens():
    s = make_sched()
    a, b = make_req("a", 40, max_tokens=1), make_req("b", 40, max_tokens=1)
    s.add_request(a)
    step(s)
    s.add_request(b)
    assert batch(step(s)) == [("b", 8)]
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 32)
    stats = s.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (80, 32)


def test_finished_ids_reported_once():
    s = make_sched()
    s.add_request(make_req("a", 4, max_tokens=1))
    step(s)
    assert s.schedule().finished_req_ids == ["a"]
    assert s.schedule().finished_req_ids == []


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("caching", [True, False])
def test_random_workload_completes_without_leaks(policy, caching):
    rng = random.Random(0)
    s = make_sched(num_blocks=12, block_size=4, max_num_seqs=4, max_batched=12, policy=policy,
                   caching=caching)
    reqs: list[Request] = []
    for i in range(30):
        prev = reqs[-1] if reqs and rng.random() < 0.3 else None
        n = prev.num_prompt_tokens if prev else rng.randint(1, 20)
        base = prev.prompt_token_ids[0] if prev else rng.choice([0, 0, 500])
        reqs.append(make_req(f"r{i}", n, max_tokens=rng.randint(1, 12), base=base,
                             priority=rng.randint(0, 2), arrival=float(i), fork_source=prev))
    for r in reqs:
        s.add_request(r)
    for _ in range(2000):
        if not s.has_unfinished_requests():
            break
        step(s)
        owners = [0] * s.kv.num_blocks
        for r in s.running:
            for block_id in r.block_ids:
                owners[block_id] += 1
        assert [b.ref_cnt for b in s.kv.pool.blocks] == owners
        assert all(not r.block_ids for r in s.waiting)
    assert not s.has_unfinished_requests()
    assert all(r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens == r.max_tokens
               for r in reqs)
    assert held_blocks(s) == 0 and s.make_stats().kv_cache_usage == 0.0


# ---- async scheduling (one step in flight) --------------------------------------------------------

def _launch(s: Scheduler) -> tuple[SchedulerOutput, list[bool]]:
    out = s.schedule()
    samples = [r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] >=
               r.num_tokens + r.num_output_placeholders for r in s.requests_of(out)]
    s.mark_in_flight(out)
    return out, samples


def _land(s: Scheduler, out: SchedulerOutput, samples: list[bool], token: int = TOKEN) -> None:
    s.update_from_output(out, result(out, [[token] if x else [] for x in samples]), in_flight=True)


def test_async_schedules_decode_of_in_flight_token():
    s = make_sched()
    a = make_req("a", 20, max_tokens=3)
    s.add_request(a)
    first, f_samples = _launch(s)  # the whole prompt; samples token 1
    assert batch(first) == [("a", 20)] and a.num_output_placeholders == 1
    second, s_samples = _launch(s)  # decodes token 1 before it is known on the host
    assert batch(second) == [("a", 1)] and second.scheduled_cached_reqs.num_computed_tokens == [20]
    _land(s, first, f_samples)
    assert a.output_token_ids == [TOKEN] and a.num_output_placeholders == 1
    third, t_samples = _launch(s)  # token 3 is the last: after it nothing more is scheduled
    assert batch(third) == [("a", 1)]
    _land(s, second, s_samples)
    assert s.schedule().num_scheduled_tokens == {}
    _land(s, third, t_samples)
    assert a.status == RequestStatus.FINISHED_LENGTH and a.num_output_tokens == 3
    assert held_blocks(s) == 0


def _two_requests_for_two_blocks() -> tuple[Scheduler, Request, Request]:
    """a and b fill the whole two-block pool; when a needs a second block, b is preempted."""
    s = make_sched(num_blocks=2, max_num_seqs=2)
    a = make_req("a", 16, max_tokens=20, arrival=0.0)
    b = make_req("b", 15, max_tokens=20, base=5000, arrival=1.0)
    s.add_request(a)
    s.add_request(b)
    return s, a, b


def test_async_token_of_request_preempted_in_flight_is_dropped():
    s, a, b = _two_requests_for_two_blocks()
    first, f_samples = _launch(s)  # a and b fill both blocks
    second, _ = _launch(s)  # a needs a second block: b (admitted last) is preempted
    assert second.preempted_req_ids == ["b"] and b.num_output_placeholders == 0
    _land(s, first, f_samples)
    assert a.output_token_ids == [TOKEN] and b.output_token_ids == []
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0


# ---- the step as data ------------------------------------------------------------------------------

def test_new_request_data_is_sent_once_then_block_deltas():
    s = make_sched(block_size=4, max_batched=8)
    a = make_req("a", 10, max_tokens=8)
    s.add_request(a)
    first = s.schedule()
    assert [d.req_id for d in first.scheduled_new_reqs] == ["a"]
    new = first.scheduled_new_reqs[0]
    assert new.prompt_token_ids == a.prompt_token_ids and new.block_ids == a.block_ids[:2]
    assert new.num_computed_tokens == 0 and new.output_token_ids == []
    s.update_from_output(first, result(first, [[]]))
    second = s.schedule()  # the rest of the prompt: one more block
    assert second.scheduled_new_reqs == []
    assert second.scheduled_cached_reqs.req_ids == ["a"]
    assert second.scheduled_cached_reqs.new_block_ids == [a.block_ids[2:3]]
    assert second.scheduled_cached_reqs.num_computed_tokens == [8]
    s.update_from_output(second, result(second, [[TOKEN]]))
    third = s.schedule()  # a decode inside the last block: no new block
    assert third.scheduled_cached_reqs.new_block_ids == [[]]


def test_resumed_request_is_sent_again_with_its_output_tokens():
    s, a, b = _two_requests_for_two_blocks()
    step(s)  # both prefilled; b sampled a token
    out = step(s)  # a needs a second block: b is preempted
    assert out.preempted_req_ids == ["b"]
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    resumed = s.schedule()
    assert [d.req_id for d in resumed.scheduled_new_reqs] == ["b"]
    assert resumed.scheduled_new_reqs[0].output_token_ids == b.output_token_ids == [TOKEN]
    assert resumed.finished_req_ids == ["a"]


def test_scheduler_output_survives_pickling():
    import pickle
    s = make_sched()
    s.add_request(make_req("a", 20, temperature=0.7, seed=3))
    out = s.schedule()
    back = pickle.loads(pickle.dumps(out))
    assert back == out and back.scheduled_new_reqs[0].sampling_params.temperature == 0.7


def test_update_refuses_an_output_of_other_requests():
    s = make_sched()
    s.add_request(make_req("a", 4))
    out = s.schedule()
    with pytest.raises(ValueError, match="scheduled"):
        s.update_from_output(out, ModelRunnerOutput(["b"], [[TOKEN]], {}, {}))


# ---- preemption by swap ---------------------------------------------------------------------------

def _three_swapping_requests(num_cpu_blocks: int = 16, mode: str = "swap",
                             swap_cost: SwapCostModel | None = None
                             ) -> tuple[Scheduler, list[Request]]:
    """_three_full_requests, with a CPU swap space."""
    s = make_sched(num_blocks=6, block_size=4, max_batched=64, num_cpu_blocks=num_cpu_blocks,
                   preemption_mode=mode, swap_cost=swap_cost)
    reqs = [make_req(rid, 8, max_tokens=8, base=100 * i) for i, rid in enumerate("abc")]
    for r in reqs:
        s.add_request(r)
    step(s)
    assert s.kv.num_free_blocks == 0
    return s, reqs


def test_swap_out_copies_the_victims_blocks_and_keeps_its_progress():
    s, (a, b, c) = _three_swapping_requests()
    c_blocks = list(c.block_ids)
    out = step(s)
    assert batch(out) == [("a", 1), ("b", 1)] and out.preempted_req_ids == ["c"]
    assert out.blocks_to_swap_out == [(c_blocks[0], 0), (c_blocks[1], 1)]
    assert out.blocks_to_swap_in == []
    # Its 8 prompt tokens stay computed; the sampled 9th is its next input.
    assert c.status == RequestStatus.SWAPPED and c.num_computed_tokens == 8 and c.num_tokens == 9
    assert c.block_ids == [] and s.kv.num_free_cpu_blocks == 14
    stats = s.make_stats()
    assert (stats.num_preemptions, stats.num_swapped_out, stats.num_swapped) == (1, 1, 1)
    assert stats.cpu_cache_usage == pytest.approx(2 / 16)


def test_swapped_request_resumes_by_copy_in_without_recompute():
    s, (a, b, c) = _three_swapping_requests()
    step(s)  # c swapped out to CPU blocks 0 and 1
    s.add_request(make_req("d", 4, base=900))  # arrives later: c resumes first
    resumed = None
    for _ in range(30):
        out = step(s)
        assert "d" not in out.num_scheduled_tokens or c.status == RequestStatus.RUNNING or \
            c.is_finished, "a new request ran before the swapped one resumed"
        if "c" in [n.req_id for n in out.scheduled_new_reqs]:
            resumed = out
            break
    assert resumed is not None
    assert sorted(cpu for cpu, _ in resumed.blocks_to_swap_in) == [0, 1]
    assert dict(resumed.blocks_to_swap_in)[0] == c.block_ids[0]
    assert dict(resumed.blocks_to_swap_in)[1] == c.block_ids[1]
    new = {n.req_id: n for n in resumed.scheduled_new_reqs}
    assert new["c"].num_computed_tokens == 8 and new["c"].block_ids == c.block_ids
    assert resumed.num_scheduled_tokens["c"] == 1  # a decode: only the last known token
    while s.has_unfinished_requests():
        step(s)
    assert c.num_output_tokens == 8 and c.num_preemptions == 1
    stats = s.make_stats()
    assert stats.num_swapped_in == stats.num_swapped_out >= 1 and stats.num_swapped == 0
    assert held_blocks(s) == 0 and s.kv.num_free_cpu_blocks == 16


def test_swap_falls_back_to_recompute_when_the_cpu_space_is_full(caplog):
    s, (a, b, c) = _three_swapping_requests(num_cpu_blocks=1)  # c needs 2
    with caplog.at_level("WARNING", logger="peregrine"):
        out = step(s)
    assert out.preempted_req_ids == ["c"] and out.blocks_to_swap_out == []
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert s.kv.num_free_cpu_blocks == 1 and s.make_stats().num_swapped_out == 0
    assert sum("swap space" in r.message for r in caplog.records) == 1
    while s.has_unfinished_requests():
        step(s)
    assert all(r.num_output_tokens == 8 for r in (a, b, c)) and held_blocks(s) == 0


def test_abort_of_a_swapped_request_frees_its_cpu_and_device_blocks():
    s, (a, b, c) = _three_swapping_requests()
    step(s)
    assert c.status == RequestStatus.SWAPPED
    s.finish_requests("c", RequestStatus.FINISHED_ABORTED)
    assert s.num_waiting == 0 and c.status == RequestStatus.FINISHED_ABORTED
    assert s.kv.num_free_cpu_blocks == 16 and not s.kv.is_swapped(c)
    assert held_blocks(s) == len(a.block_ids) + len(b.block_ids)
    s.finish_requests(["a", "b"], RequestStatus.FINISHED_ABORTED)
    assert held_blocks(s) == 0
    assert sorted(s.kv.pool.free_queue.block_ids()) == list(range(6))
    assert all(blk.ref_cnt == 0 for blk in s.kv.pool.blocks)


def test_swap_keeps_blocks_shared_with_other_requests_on_the_device():
    s = make_sched(num_blocks=6, block_size=4, num_cpu_blocks=8, preemption_mode="swap")
    a = make_req("a", 8, max_tokens=8, base=100)  # 4 blocks at the end
    s.add_request(a)
    step(s)  # a's prompt blocks are computed and cached
    b = Request("b", a.prompt_token_ids + [7, 7, 7, 7], SamplingParams(max_tokens=8),
                arrival_time=1.0, eos_token_ids=(EOS,), max_tokens=8)  # 5, 2 shared with a
    s.add_request(b)
    step(s)
    shared = b.block_ids[:2]
    assert shared == a.block_ids[:2]  # a prefix hit on a's two prompt blocks
    out = None
    for _ in range(10):
        out = step(s)
        if out.preempted_req_ids:
            break
    assert out.preempted_req_ids == ["b"] and b.status == RequestStatus.SWAPPED
    own = [dev for dev, _ in out.blocks_to_swap_out]
    assert own and not set(own) & set(shared)  # only the blocks b held alone were copied
    assert [s.kv.pool.blocks[i].ref_cnt for i in shared] == [2, 2]  # b still holds them
    assert s.kv.swapped_device_blocks(b) == 2
    while s.has_unfinished_requests():
        step(s)
    assert a.num_output_tokens == b.num_output_tokens == 8
    assert held_blocks(s) == 0 and s.kv.num_free_cpu_blocks == 8


def _tiny_cost(block_size: int = 4) -> SwapCostModel:
    return SwapCostModel.for_model(bytes_per_block=4096, block_size=block_size, num_layers=2,
                                   hidden_size=64, intermediate_size=128, num_heads=4,
                                   num_kv_heads=2, head_dim=16, device="cpu")


def test_auto_recomputes_short_and_swaps_long_requests():
    cost = _tiny_cost()
    cross = cost.crossover_tokens()
    assert 4 < cross < 200
    short, long_ = cross // 2, 2 * cross
    for prompt, want in ((short, RequestStatus.PREEMPTED), (long_, RequestStatus.SWAPPED)):
        blocks = max(1, prompt // 4)
        s = make_sched(num_blocks=2 * blocks, block_size=4, max_batched=1024, max_model_len=1024,
                       num_cpu_blocks=1000, preemption_mode="auto", swap_cost=cost)
        # Two prompts that fill their blocks exactly: the first decode needs a new block.
        x = make_req("x", blocks * 4, max_tokens=4, base=0)
        y = make_req("y", blocks * 4, max_tokens=4, base=5000)
        s.add_request(x)
        s.add_request(y)
        step(s)
        assert s.kv.num_free_blocks == 0
        out = step(s)
        assert out.preempted_req_ids == ["y"]
        assert y.status == want, (prompt, cross)
        assert bool(out.blocks_to_swap_out) == (want == RequestStatus.SWAPPED)


def test_auto_without_costs_or_cpu_space_recomputes():
    for kw in ({"swap_cost": None, "num_cpu_blocks": 16}, {"swap_cost": _tiny_cost()}):
        s = make_sched(num_blocks=6, block_size=4, preemption_mode="auto", **kw)
        reqs = [make_req(rid, 8, max_tokens=8, base=100 * i) for i, rid in enumerate("abc")]
        for r in reqs:
            s.add_request(r)
        step(s)
        step(s)
        assert reqs[2].status == RequestStatus.PREEMPTED


def test_recompute_mode_never_swaps():
    s, (a, b, c) = _three_swapping_requests(mode="recompute")
    out = step(s)
    assert out.blocks_to_swap_out == [] and c.status == RequestStatus.PREEMPTED


def test_unknown_preemption_mode_rejected():
    with pytest.raises(ValueError, match="preemption mode"):
        make_sched(preemption_mode="spill")


def test_cost_model_prefers_recompute_short_and_swap_long_for_llama3_8b():
    # Llama-3-8B: 32 layers, hidden 4096, 32 heads / 8 KV heads of 128, MLP 14336, bf16 KV.
    per_block = 2 * 32 * 16 * 8 * 128 * 2
    cost = SwapCostModel.for_model(bytes_per_block=per_block, block_size=16, num_layers=32,
                                   hidden_size=4096, intermediate_size=14336, num_heads=32,
                                   num_kv_heads=8, head_dim=128, device="cuda")
    assert cost.flops_per_token == pytest.approx(2 * 6.98e9, rel=0.01)
    assert not cost.prefers_swap(16, 1)
    assert cost.prefers_swap(4096, 256)
    assert 16 < cost.crossover_tokens() < 256
    # Blocks kept on the device (shared prefix) are not recomputed: a long shared prefix with a
    # short private tail recomputes the tail.
    assert not cost.prefers_swap(4096, 1, num_kept_tokens=4080)
    # Faster copies move the crossover down.
    fast = DeviceCosts(copy_bandwidth=1e12, flops_per_s=cost.device.flops_per_s,
                       fixed_s=cost.device.fixed_s, copy_launch_s=cost.device.copy_launch_s)
    faster = SwapCostModel(**{**cost.__dict__, "device": fast})
    assert faster.crossover_tokens() < cost.crossover_tokens()
    assert not cost.prefers_swap(4096, 0)  # nothing to copy: nothing to gain


def _two_swapped_sharing_requests() -> tuple[Scheduler, Request, Request]:
    """e and its fork d, both swapped out, still holding their two shared prompt blocks."""
    s = make_sched(num_blocks=6, block_size=4, num_cpu_blocks=16, preemption_mode="swap")
    e = make_req("e", 9, max_tokens=4, base=100)
    s.add_request(e)
    step(s)
    d = make_req("d", 9, max_tokens=4, base=100, fork_source=e)
    s.add_request(d)
    step(s)
    assert d.block_ids[:2] == e.block_ids[:2]
    s._preempt(d)  # as a third request's growth would
    s._preempt(e)
    s._swap_out.clear()  # (the copies would have gone out with that request's step)
    assert d.status == e.status == RequestStatus.SWAPPED and s.num_running == 0
    assert s.kv.swapped_device_blocks(d) == s.kv.swapped_device_blocks(e) == 2
    return s, e, d


def test_lone_request_out_of_blocks_takes_the_shared_blocks_of_swapped_ones():
    s, e, d = _two_swapped_sharing_requests()
    b = make_req("b", 16, max_tokens=4, base=500)  # 4 blocks now, 5 with its first decode
    s.add_request(b)
    s.waiting.sort(key=lambda r: r.request_id != "b")  # b first (it would be a new arrival)
    assert batch(step(s)) == [("b", 16)]
    out = step(s)  # b needs a 5th block; 4 are free while the swapped requests hold 2
    assert batch(out) == [("b", 1)] and not b.is_finished
    assert e.status == d.status == RequestStatus.PREEMPTED  # they recompute instead
    assert s.kv.num_free_cpu_blocks == 16
    while s.has_unfinished_requests():
        step(s)
    assert [r.num_output_tokens for r in (b, e, d)] == [4, 4, 4] and held_blocks(s) == 0


def test_swapped_request_that_cannot_resume_with_nothing_running_frees_other_holds():
    s, e, d = _two_swapped_sharing_requests()
    c = make_req("c", 16, max_tokens=4, base=500)
    s.add_request(c)
    s.waiting.sort(key=lambda r: r.request_id != "c")
    step(s)  # c prefilled: 4 blocks
    s._preempt(c)  # swapped: 4 CPU blocks; it resumes first but needs 5 of the 4 free blocks
    s._swap_out.clear()
    assert c.status == RequestStatus.SWAPPED and s.waiting[0] is c
    out = step(s)
    assert batch(out) == [("c", 1)] and len(out.blocks_to_swap_in) == 4
    assert e.status == d.status == RequestStatus.PREEMPTED
    while s.has_unfinished_requests():
        step(s)
    assert [r.num_output_tokens for r in (c, e, d)] == [4, 4, 4] and held_blocks(s) == 0
    assert s.kv.num_free_cpu_blocks == 16


def test_failed_step_turns_its_swap_outs_into_recomputes():
    s, (a, b, c) = _three_swapping_requests()
    out = s.schedule()
    assert out.preempted_req_ids == ["c"] and c.status == RequestStatus.SWAPPED
    s.fail_step(out, "device lost")
    assert a.status == b.status == RequestStatus.FINISHED_ERROR
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert s.kv.num_free_cpu_blocks == 16 and held_blocks(s) == 0
    while s.has_unfinished_requests():
        step(s)
    assert c.num_output_tokens == 8
