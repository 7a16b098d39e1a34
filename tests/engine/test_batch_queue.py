"""The scheduler under pipeline parallelism (max_concurrent_batches > 1): steps in flight hold
disjoint requests, victims are never in flight, and the workers learn the sampled tokens."""
from __future__ import annotations

from peregrine.config import CacheConfig, SchedulerConfig
from peregrine.engine.request import Request
from peregrine.engine.scheduler import Scheduler
from peregrine.messages import ModelRunnerOutput, SchedulerOutput
from peregrine.sampling_params import SamplingParams


def make_sched(num_blocks: int = 64, max_batched: int = 64, depth: int = 2) -> Scheduler:
    sc = SchedulerConfig(8, max_batched, 256, True, "fcfs", None, "recompute",
                         max_concurrent_batches=depth)
    return Scheduler(sc, CacheConfig(4, 0.9, 1.0, None, True), num_blocks)


def make_req(rid: str, num_prompt: int, max_tokens: int = 8) -> Request:
    return Request(rid, [100 + i for i in range(num_prompt)], SamplingParams(max_tokens=max_tokens),
                   arrival_time=0.0, eos_token_ids=(2,), max_tokens=max_tokens)


def launch(s: Scheduler) -> SchedulerOutput:
    out = s.schedule()
    s.mark_in_flight(out)
    return out


def collect(s: Scheduler, out: SchedulerOutput, token: int) -> None:
    sampled = [[token] if r.num_output_placeholders else [] for r in s.requests_of(out)]
    s.update_from_output(out, ModelRunnerOutput(list(out.num_scheduled_tokens), sampled, {}, {}),
                         in_flight=True)


def test_a_request_in_flight_is_not_scheduled_again_until_its_step_is_collected() -> None:
    s = make_sched()
    s.add_request(make_req("a", 5))
    first = launch(s)
    s.add_request(make_req("b", 3))
    second = launch(s)  # a is in flight: only b
    assert list(first.num_scheduled_tokens) == ["a"]
    assert list(second.num_scheduled_tokens) == ["b"]
    assert launch(s).total_num_scheduled_tokens == 0  # both in flight: nothing to run
    collect(s, first, 7)
    third = launch(s)
    assert third.num_scheduled_tokens == {"a": 1}
    # the stages before the last sample nothing: they learn a's token here
    assert third.scheduled_cached_reqs.req_ids == ["a"]
    assert third.scheduled_cached_reqs.new_token_ids == [[7]]
    collect(s, second, 9)
    collect(s, third, 11)
    fourth = launch(s)  # one request per step: two running split over two steps
    assert fourth.scheduled_cached_reqs.req_ids == ["a"]
    assert fourth.scheduled_cached_reqs.new_token_ids == [[11]]
    fifth = launch(s)
    assert fifth.scheduled_cached_reqs.req_ids == ["b"]
    assert fifth.scheduled_cached_reqs.new_token_ids == [[9]]


def test_the_requests_split_evenly_over_the_steps_in_flight() -> None:
    s = make_sched(depth=2)
    for i in range(5):
        s.add_request(make_req(f"r{i}", 3))
    first, second = launch(s), launch(s)
    assert list(first.num_scheduled_tokens) == ["r0", "r1", "r2"]  # ceil(5 / 2)
    assert list(second.num_scheduled_tokens) == ["r3", "r4"]
    assert launch(s).total_num_scheduled_tokens == 0
    collect(s, first, 7)
    assert list(launch(s).num_scheduled_tokens) == ["r0", "r1", "r2"]


def test_a_victim_is_never_a_request_in_flight() -> None:
    # two 4-token blocks: a and b fill one each; a's first decode needs a block nobody frees
    s = make_sched(num_blocks=2)
    s.add_request(make_req("a", 4))
    first = launch(s)
    s.add_request(make_req("b", 4))
    second = launch(s)
    collect(s, first, 7)
    out = s.schedule()
    # fcfs would take the last admitted (b), but b is in flight: a gives way instead
    assert out.preempted_req_ids == ["a"]
    assert out.total_num_scheduled_tokens == 0
    assert s.get_request("b").num_preemptions == 0
    collect(s, second, 9)
    out = s.schedule()
    assert out.num_scheduled_tokens == {"b": 1}
    assert out.scheduled_cached_reqs.new_token_ids == [[9]]


def test_one_step_at_a_time_sends_no_tokens_to_the_workers() -> None:
    s = make_sched(depth=1)
    s.add_request(make_req("a", 5))
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput(["a"], [[7]], {}, {}))
    again = s.schedule()
    assert again.scheduled_cached_reqs.req_ids == ["a"]
    assert again.scheduled_cached_reqs.new_token_ids == []
