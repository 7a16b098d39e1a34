"""Host time per step of the engine core and the front end with N requests decoding, on the CPU.

No model: a fake executor samples one token for every request whose chunk reaches the end of its
known tokens, as the model runner decides it. Everything else (scheduler, KV cache manager with
prefix caching, EngineCore, StepPipeline, LLMEngine over an in-process core client) is the real
code. Prints ms per step for each phase:

    schedule    Scheduler.schedule
    update      Scheduler.update_from_output (tokens, stop checks, block caching)
    outputs     the rest of EngineCore.complete (EngineCoreOutputs) and of EngineCore.step
                (first-scheduled times, prompt-token count, finished, stats)
    apply       LLMEngine._apply
    make_output RequestGroup.make_output for the touched groups, and retiring them

    python benchmarks/core_host_probe.py [--num-seqs 1000 256] [--steps 100] [--profile]
        [--freeze-gc] [--output-kind cumulative|delta|final_only]

Measured on this CPU (ms per step, cumulative outputs, best of 5; at 1000 requests the numbers
move by +-30% from run to run, mostly with garbage collections):

    seqs async  version          schedule update outputs apply make_output  total
    1000 on     before              2.81   1.93    1.54   1.42     11.57    19.28
    1000 on     after               1.66   1.19    0.89   1.26      8.89    13.89
    1000 on     after, gc frozen    1.30   1.00    0.93   0.91      4.09     8.23
    1000 off    before              2.47   1.89    0.98   1.38      8.28    15.00
    1000 off    after, gc frozen    1.29   1.18    0.51   0.94      4.19     8.11
     256 on     before              0.52   0.38    0.31   0.24      1.27     2.73
     256 on     after               0.25   0.19    0.16   0.15      0.69     1.44
     256 off    before              0.48   0.42    0.25   0.24      1.37     2.77
     256 off    after               0.23   0.22    0.11   0.14      0.66     1.36

"gc frozen" is what the engine core process does after start-up (gc.freeze); with the old code
and the heap frozen, 1000 requests took 10.9 (async) and 13.4 ms (sync), 256 took 2.4 ms.
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from peregrine.config import EngineArgs, EngineConfig  # noqa: E402
from peregrine.engine.core import EngineCore  # noqa: E402
from peregrine.engine.core_client import InprocCoreClient  # noqa: E402
from peregrine.engine.llm_engine import LLMEngine  # noqa: E402
from peregrine.executor.base import Executor  # noqa: E402
from peregrine.messages import ModelRunnerOutput, SchedulerOutput  # noqa: E402
from peregrine.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402
from peregrine.testing.checkpoints import tiny_checkpoint  # noqa: E402

PHASES = ("schedule", "update", "outputs", "apply", "make_output")


class _Done:
    """A step future whose result is already there."""

    def __init__(self, result: ModelRunnerOutput) -> None:
        self._result = result

    def result(self) -> ModelRunnerOutput:
        return self._result


class FakeExecutor(Executor):
    """Tracks each request's tokens as a worker does and samples token 7 where the model would."""

    num_blocks = 1 << 16

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._num_tokens: dict[str, int] = {}  # prompt + outputs, in-flight samples included

    def execute_model(self, scheduler_output: SchedulerOutput) -> _Done:
        """Sample where a worker would: a chunk that reaches the request's last known token."""
        so = scheduler_output
        for rid in so.finished_req_ids:
            self._num_tokens.pop(rid, None)
        for rid in so.preempted_req_ids:
            self._num_tokens.pop(rid, None)
        computed: dict[str, int] = {}
        for new in so.scheduled_new_reqs:
            self._num_tokens[new.req_id] = len(new.prompt_token_ids) + len(new.output_token_ids)
            computed[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        req_ids = list(so.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for rid, n in so.num_scheduled_tokens.items():
            if computed[rid] + n >= self._num_tokens[rid]:
                self._num_tokens[rid] += 1
                sampled.append([7])
            else:
                sampled.append([])
        return _Done(ModelRunnerOutput(req_ids, sampled, {}, {}))

    def check_health(self) -> None:
        pass


def build_engine(num_seqs: int, async_scheduling: bool) -> LLMEngine:
    """An LLMEngine over an in-process EngineCore with the fake executor."""
    args = EngineArgs(model=tiny_checkpoint("llama"), device="cpu", dtype="float32",
                      skip_tokenizer_init=True, max_model_len=512,
                      max_num_seqs=max(1024, num_seqs), async_scheduling=async_scheduling)
    config = args.create_engine_config()
    client = InprocCoreClient.__new__(InprocCoreClient)
    client.core = EngineCore(config, FakeExecutor)
    return LLMEngine(config, core_client=client)


def _timed(obj, name: str, acc: dict[str, float], key: str) -> None:
    """Wrap obj.name (an instance attribute now) so its seconds add up in acc[key]."""
    fn = getattr(obj, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[key] += time.perf_counter() - t0

    setattr(obj, name, wrapper)


def run(num_seqs: int, async_scheduling: bool, steps: int, kind: RequestOutputKind,
        profile: bool = False, freeze_gc: bool = False) -> dict[str, float]:
    """Ms per step of each phase over `steps` decode steps of num_seqs running requests."""
    engine = build_engine(num_seqs, async_scheduling)
    if freeze_gc:  # as the engine core process does once it is built
        gc.collect()
        gc.freeze()
    core = engine.core_client.core
    rng = random.Random(0)
    sp = SamplingParams(max_tokens=180, ignore_eos=True, output_kind=kind)
    for i in range(num_seqs):
        engine.add_request(str(i), [rng.randrange(10, 500) for _ in range(200)], sp)
    sched = core.scheduler
    while sched.waiting or any(r.num_output_tokens == 0 for r in sched.running):
        engine.step()
    for _ in range(3):
        engine.step()
    assert steps + 10 < 180, "every request must still be decoding at the end"
    acc = dict.fromkeys(("sched_update", "apply"), 0.0)
    _timed(sched, "update_from_output", acc, "sched_update")
    _timed(engine, "_apply", acc, "apply")
    core.timing.clear()
    engine.timing.clear()
    prof = cProfile.Profile() if profile else None
    if prof:
        prof.enable()
    for _ in range(steps):
        engine.step()
    if prof:
        prof.disable()
        stats = pstats.Stats(prof).sort_stats("tottime")
        stats.print_stats(25)
    assert sched.num_running == num_seqs
    if freeze_gc:
        gc.unfreeze()  # the next run starts as this one did
    ct, ft = core.timing, engine.timing
    out = {
        "schedule": ct["schedule"],
        "update": acc["sched_update"],
        "outputs": ct["step_total"] - ct["schedule"] - ct["launch"] - ct["collect"]
        - acc["sched_update"],
        "apply": acc["apply"],
        "make_output": ft["process"] - acc["apply"],
    }
    return {k: v / steps * 1e3 for k, v in out.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--num-seqs", type=int, nargs="+", default=[1000, 256])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--repeats", type=int, default=3, help="best of this many runs per setting")
    p.add_argument("--output-kind", choices=[k.name.lower() for k in RequestOutputKind],
                   default="cumulative")
    p.add_argument("--profile", action="store_true", help="cProfile one run per setting")
    p.add_argument("--freeze-gc", action="store_true",
                   help="gc.freeze() after start-up, as the engine core process does")
    ns = p.parse_args()
    kind = RequestOutputKind[ns.output_kind.upper()]
    frozen = ", gc frozen after start-up" if ns.freeze_gc else ""
    print(f"ms per step ({ns.output_kind} outputs, best of {ns.repeats}{frozen})")
    print(f"{'seqs':>5} {'async':>5} " + " ".join(f"{k:>11}" for k in PHASES) + f" {'total':>8}")
    for num_seqs in ns.num_seqs:
        for async_scheduling in (True, False):
            if ns.profile:
                run(num_seqs, async_scheduling, ns.steps, kind, True, ns.freeze_gc)
            runs = [run(num_seqs, async_scheduling, ns.steps, kind, False, ns.freeze_gc)
                    for _ in range(ns.repeats)]
            best = {k: min(r[k] for r in runs) for k in PHASES}
            print(f"{num_seqs:>5} {str(async_scheduling):>5} "
                  + " ".join(f"{best[k]:>11.3f}" for k in PHASES)
                  + f" {sum(best.values()):>8.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
