"""Where each step of W1 spends its time: host phases, GPU time and GPU idle, per step.

Runs `peregrine bench throughput`'s workload (same flags, same requests) in process and records,
for every engine step, the host seconds of each phase (front end, core, runner) and two CUDA
events per launched step: one queued before its forward, one after its sampling. From those:

    device_ms  the step's GPU time (start event to end event)
    idle_ms    the device's idle time before the step (previous end event to this start event):
               time the device waited for the host to queue work

Steps are grouped by how many sequences they run (and whether they only decode); each group
prints its count, mean host ms per phase, mean device ms and the summed device idle. Mixed steps
also count the CUDA caching allocator's device allocations, frees and retries during their launch.
Without CUDA the events are host clocks (a smoke test of the script). The device
idle summed over the run is what host work costs the run's wall time.

    python benchmarks/step_trace.py --model benchmarks/configs/qwen3-0.6b.json --out trace.json
"""
from __future__ import annotations

import json
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from peregrine.bench.offline import (  # noqa: E402
    _engine_args, _max_token_id, _sync, build_parser, host_timings, w1_requests)
from peregrine.sampling_params import SamplingParams  # noqa: E402

class _HostEvent:
    """A stand-in for a timing CUDA event on a machine without CUDA (host clock only)."""

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, other: "_HostEvent") -> float:
        return (other.t - self.t) * 1e3


MEMORY_COUNTERS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")
BUCKETS = (1, 8, 16, 32, 64, 128, 192, 256, 1 << 30)


def _bucket(n: int) -> str:
    lo = 0
    for hi in BUCKETS:
        if n <= hi:
            return f"{lo + 1}-{hi}" if hi < (1 << 30) else f">{lo}"
        lo = hi
    raise AssertionError(n)


def main(argv: list[str] | None = None) -> dict:
    import torch
    p = build_parser("throughput")
    p.add_argument("--out", default=None, help="write every step's record as JSON here")
    ns = p.parse_args(argv)
    from peregrine.entrypoints.llm import LLM
    llm = LLM(**_engine_args(ns, max_model_len=ns.max_input + ns.max_output))
    prompts, out_lens = w1_requests(ns.num_prompts, ns.seed, ns.min_input, ns.max_input,
                                    ns.min_output, ns.max_output,
                                    _max_token_id(llm.engine.config.model.vocab_size))
    params = [SamplingParams(temperature=ns.temperature, max_tokens=n, ignore_eos=True, seed=i,
                             detokenize=ns.detokenize) for i, n in enumerate(out_lens)]
    warm = prompts[:4]  # compilation and autotuning outside the trace, as the benchmark does
    llm.generate(warm, [SamplingParams(max_tokens=min(8, ns.max_output), ignore_eos=True)]
                 * len(warm), use_tqdm=False)
    _sync()
    engine = llm.engine
    timings = host_timings(engine)
    runner = engine.core_client.core.executor.worker.model_runner
    launches: list[dict] = []  # one per launched step

    def make_event():
        return torch.cuda.Event(enable_timing=True)

    original_execute = runner.execute_model

    def execute(sched):
        n = len(sched.num_scheduled_tokens)
        mixed = sched.total_num_scheduled_tokens != n
        mem = torch.cuda.memory_stats() if mixed and torch.cuda.is_available() else None
        start = make_event()
        start.record()
        handle = original_execute(sched)
        end = make_event()
        end.record()
        rec = {"seqs": n, "tokens": sched.total_num_scheduled_tokens, "decode_only": not mixed,
               "start": start, "end": end}
        if mem is not None:  # the caching allocator's device calls during a mixed step's launch
            after = torch.cuda.memory_stats()
            for k in MEMORY_COUNTERS:
                rec[f"mem_{k}"] = after.get(k, 0) - mem.get(k, 0)
        launches.append(rec)
        return handle

    runner.execute_model = execute
    if not torch.cuda.is_available():
        make_event = _HostEvent
    steps: list[dict] = []
    original_step = engine.step

    def step():
        before = {part: dict(t) for part, t in timings.items()}
        n_before = len(launches)
        t0 = time.perf_counter()
        result = original_step()
        rec = {"wall_ms": (time.perf_counter() - t0) * 1e3, "launch": n_before
               if len(launches) > n_before else None}
        for part, t in timings.items():
            for k, v in t.items():
                d = v - before[part].get(k, 0.0)
                if d and not k.endswith("steps"):
                    rec[f"{part}_{k}"] = d * 1e3
        steps.append(rec)
        return result

    engine.step = step
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    _sync()
    elapsed = time.perf_counter() - t0
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    prev_end = None
    for rec in launches:
        rec["device_ms"] = rec["start"].elapsed_time(rec["end"])
        rec["idle_ms"] = prev_end.elapsed_time(rec["start"]) if prev_end is not None else 0.0
        prev_end = rec.pop("end")
        rec.pop("start")
    for rec in steps:
        if rec["launch"] is not None:
            rec.update(launches[rec["launch"]])
    groups: dict[str, list[dict]] = defaultdict(list)
    for rec in steps:
        if rec["launch"] is None:
            continue
        kind = "decode" if rec["decode_only"] else "mixed"
        groups[f"{kind} {_bucket(rec['seqs'])}"].append(rec)
    keys = sorted({k for rec in steps for k in rec if k.split("_")[0] in
                   ("engine", "core", "runner", "mem") and not k.endswith("step_total")})
    print(f"W1: {out_tokens} output tokens in {elapsed:.3f} s = {out_tokens / elapsed:,.0f} tok/s; "
          f"{len(steps)} engine steps, {len(launches)} launches; device idle "
          f"{sum(r['idle_ms'] for r in launches):.0f} ms, device busy "
          f"{sum(r['device_ms'] for r in launches):.0f} ms")
    summary = {}
    for name in sorted(groups, key=lambda g: (g.split()[0], int(g.split()[1].strip(">").split("-")[0]))):
        recs = groups[name]
        row = {"steps": len(recs),
               "wall_ms": sum(r["wall_ms"] for r in recs) / len(recs),
               "device_ms": sum(r["device_ms"] for r in recs) / len(recs),
               "idle_ms_sum": sum(r["idle_ms"] for r in recs)}
        for k in keys:
            row[k] = sum(r.get(k, 0.0) for r in recs) / len(recs)
        summary[name] = row
        print(f"{name:>14}: {len(recs):5d} steps, wall {row['wall_ms']:.3f} ms, device "
              f"{row['device_ms']:.3f} ms, idle sum {row['idle_ms_sum']:.0f} ms | " +
              " ".join(f"{k}={row[k]:.3f}" for k in keys if row[k] >= 0.005))
    result = {"elapsed_s": elapsed, "output_tokens": out_tokens, "summary": summary,
              "steps": steps}
    if ns.out:
        Path(ns.out).write_text(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
