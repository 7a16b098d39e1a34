"""Where a served request's time to first token goes inside the engine core.

Requests arrive at a fixed mean rate (Poisson) into the loop the core process runs
(`core_client.serve_core`, launch pacing included), in this process, with no HTTP front end;
every launched step gets two CUDA events (before its forward, after its sampling). W3's mix by
default: prompts of 180-220 random token ids, 162-198 output tokens, 8 requests/s. For every
request the core-side TTFT splits into

    wait    arrival at the core's inbox -> scheduled
    lag     scheduled -> its step starts on the device (the step in flight ahead of it, and any
            device idle while the host prepares it)
    device  its step's GPU time (start event -> end event)
    out     device end -> its first token leaves the core

and every step records its host phases and the device idle before it. One engine serves several
pacer settings in turn (`--pacers`), so they are compared on the same process and machine:

    python benchmarks/pacing_trace.py --model benchmarks/configs/llama-3-8b.json \
        --pacers off,default,1.0:0.25 --num-prompts 200 --out trace.json

A pacer setting is `off`, `default`, or `MARGIN:FRACTION`: the idle time left unspent per step
is max(MARGIN ms, FRACTION of the idle time).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from peregrine.config import EngineArgs, EngineConfig  # noqa: E402
from peregrine.engine.core import EngineCore, EngineCoreRequest  # noqa: E402
from peregrine.engine.core_client import freeze_startup_heap, serve_core  # noqa: E402
from peregrine.engine.pacing import LaunchPacer  # noqa: E402
from peregrine.sampling_params import SamplingParams  # noqa: E402


class _HostEvent:
    """A stand-in for a timing CUDA event on a machine without CUDA (host clock only)."""

    def record(self) -> None:
        self.t = time.monotonic()

    def elapsed_time(self, other: "_HostEvent") -> float:
        return (other.t - self.t) * 1e3


class ArrivalInbox:
    """The core's inbox with requests arriving at given times (seconds after start()); says
    shutdown once every request has finished."""

    def __init__(self, arrivals: list[tuple[float, EngineCoreRequest]], sink: "Sink") -> None:
        self.arrivals = arrivals
        self.sink = sink
        self.next = 0
        self.t0 = 0.0
        self.arrived: dict[str, float] = {}

    def start(self) -> None:
        self.t0 = time.monotonic()

    def _due(self) -> float:
        return self.t0 + self.arrivals[self.next][0]

    def poll(self, timeout: float = 0.0) -> bool:
        deadline = time.monotonic() + (timeout or 0.0)
        while True:
            if self.next == len(self.arrivals):
                if len(self.sink.finished) == len(self.arrivals):
                    return True
                wake = deadline
            else:
                if self._due() <= time.monotonic():
                    return True
                wake = min(deadline, self._due())
            left = wake - time.monotonic()
            if left <= 0:
                return False
            time.sleep(left)

    def recv(self) -> list[tuple]:
        if self.next == len(self.arrivals):
            return [("shutdown", None)]
        now, batch = time.monotonic(), []
        while self.next < len(self.arrivals) and self._due() <= now:
            due = self._due()
            _, r = self.arrivals[self.next]
            r.arrival_time = due
            self.arrived[r.request_id] = due
            batch.append(r)
            self.next += 1
        return [("add", batch)]


class Sink:
    """The core's sender: notes when each request's first token left, and what finished."""

    error = None

    def __init__(self) -> None:
        self.first_token: dict[str, float] = {}
        self.scheduled: dict[str, float] = {}
        self.finished: set[str] = set()

    def put(self, msg: tuple) -> None:
        kind, out = msg
        now = time.monotonic()
        for rid in out.req_ids:
            self.first_token.setdefault(rid, now)
        for rid, (t, _) in out.first_scheduled.items():
            self.scheduled[rid] = t
        self.finished.update(out.finished)


def _requests(ns: argparse.Namespace, vocab: int, tag: str,
              stream: int) -> list[tuple[float, EngineCoreRequest]]:
    # NOTE: every stream draws its own prompts: a repeat would hit the prefix cache.
    rng = random.Random(f"{ns.seed}-{stream}")
    t, out = 0.0, []
    for i in range(ns.num_prompts):
        t += rng.expovariate(ns.rate)
        plen = rng.randint(ns.min_input, ns.max_input)
        olen = rng.randint(ns.min_output, ns.max_output)
        ids = [rng.randrange(100, vocab) for _ in range(plen)]
        params = SamplingParams(temperature=0.0, max_tokens=olen, ignore_eos=True)
        out.append((t, EngineCoreRequest(f"{tag}-{i}", ids, params, arrival_time=0.0,
                                         max_tokens=olen, seed=i, eos_token_ids=())))
    return out


def _pacer(setting: str) -> LaunchPacer | None:
    if setting == "off":
        return None
    if setting in ("default", "warm"):  # "warm": the warm-up stream
        return LaunchPacer()
    margin, fraction = setting.split(":")
    return LaunchPacer(min_margin_s=float(margin) / 1e3, margin_fraction=float(fraction))


def _stats(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    pick = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
    return {"mean": statistics.fmean(xs), "p10": pick(0.1), "p50": statistics.median(xs),
            "p90": pick(0.9), "p99": pick(0.99)}


PHASES = ("prepare", "forward_launch", "sample_launch")


def run_one(core: EngineCore, runner, ns: argparse.Namespace, setting: str, torch,
            stream: int) -> dict:
    """Serve one arrival stream under one pacer setting; the per-request and per-step record."""
    cuda = torch.cuda.is_available()
    profile = None
    if ns.cprofile and setting != "warm":
        import cProfile
        profile = cProfile.Profile()
    make_event = (lambda: torch.cuda.Event(enable_timing=True)) if cuda else _HostEvent
    launches: list[dict] = []
    original = runner.execute_model

    def execute(sched):
        mixed = sched.total_num_scheduled_tokens != len(sched.num_scheduled_tokens)
        if profile is not None and mixed:
            profile.enable()
            try:
                return launch(sched)
            finally:
                profile.disable()
        return launch(sched)

    def launch(sched):
        start = make_event()
        start.record()
        before = [runner.timing.get(k, 0.0) for k in PHASES]
        t = time.monotonic()
        handle = original(sched)
        end = make_event()
        end.record()
        rec = {"t_launch": t, "t_launched": time.monotonic(), "start": start, "end": end,
               "req_ids": list(sched.num_scheduled_tokens),
               "tokens": sched.total_num_scheduled_tokens}
        for k, b in zip(PHASES, before):
            rec[k] = (runner.timing.get(k, 0.0) - b) * 1e3
        launches.append(rec)
        return handle

    sink = Sink()
    inbox = ArrivalInbox(_requests(ns, min(ns.vocab, core.config.model.vocab_size), setting,
                                   stream), sink)
    if cuda:
        torch.cuda.synchronize()
    origin = make_event()
    origin.record()
    if cuda:
        torch.cuda.synchronize()
    h0 = time.monotonic()
    runner.execute_model = execute
    try:
        inbox.start()
        serve_core(core, inbox, sink, _pacer(setting))
    finally:
        runner.execute_model = original
    # NOTE: the device's event clock drifts from the host's by up to tens of ppm (~1 ms over a
    # run): events are placed on the host clock by two anchors, one before and one after.
    final = make_event()
    final.record()
    if cuda:
        torch.cuda.synchronize()
    h1 = time.monotonic()
    span = origin.elapsed_time(final) / 1e3
    scale = (h1 - h0) / span if span > 0 else 1.0
    prev_end = None
    for rec in launches:
        start, end = rec.pop("start"), rec.pop("end")
        rec["dev_start"] = h0 + origin.elapsed_time(start) / 1e3 * scale
        rec["dev_end"] = h0 + origin.elapsed_time(end) / 1e3 * scale
        rec["idle_ms"] = max(0.0, (rec["dev_start"] - prev_end) * 1e3) if prev_end else 0.0
        prev_end = rec["dev_end"]
    first_step: dict[str, dict] = {}
    for rec in launches:
        for rid in rec["req_ids"]:
            first_step.setdefault(rid, rec)
    parts = {k: [] for k in ("ttft", "wait", "lag", "device", "out", "idle_before")}
    for rid, arrived in inbox.arrived.items():
        # NOTE: the first token comes from the last chunk of the prompt; W3's prompts fit one step.
        step = first_step[rid]
        parts["ttft"].append(sink.first_token[rid] - arrived)
        parts["wait"].append(sink.scheduled[rid] - arrived)
        parts["lag"].append(step["dev_start"] - sink.scheduled[rid])
        parts["device"].append(step["dev_end"] - step["dev_start"])
        parts["out"].append(sink.first_token[rid] - step["dev_end"])
        parts["idle_before"].append(step["idle_ms"] / 1e3)
    decode = [r for r in launches if r["tokens"] == len(r["req_ids"])]
    mixed = [r for r in launches if r["tokens"] != len(r["req_ids"])]
    result = {"setting": setting, "requests": len(inbox.arrived),
              "per_request_ms": {k: _stats([x * 1e3 for x in v]) for k, v in parts.items()},
              "steps": {"decode": len(decode), "mixed": len(mixed)},
              "decode_device_ms": statistics.fmean(
                  [(r["dev_end"] - r["dev_start"]) * 1e3 for r in decode]) if decode else 0.0,
              "mixed_device_ms": statistics.fmean(
                  [(r["dev_end"] - r["dev_start"]) * 1e3 for r in mixed]) if mixed else 0.0,
              "decode_idle_ms_mean": statistics.fmean([r["idle_ms"] for r in decode]) if decode else 0.0,
              "mixed_idle_ms_mean": statistics.fmean([r["idle_ms"] for r in mixed]) if mixed else 0.0,
              "mixed_launch_ms": statistics.fmean(
                  [(r["t_launched"] - r["t_launch"]) * 1e3 for r in mixed]) if mixed else 0.0,
              "decode_launch_ms": statistics.fmean(
                  [(r["t_launched"] - r["t_launch"]) * 1e3 for r in decode]) if decode else 0.0,
              "clock_scale": scale}
    for kind, recs in (("decode", decode), ("mixed", mixed)):
        for k in PHASES:
            result[f"{kind}_{k}_ms"] = statistics.fmean(r[k] for r in recs) if recs else 0.0
    if profile is not None:
        import io
        import pstats
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
        result["cprofile_mixed"] = text.getvalue()
    if ns.keep_steps:
        result["launches"] = [{k: v for k, v in r.items() if k != "req_ids"} | {"seqs": len(r["req_ids"])}
                              for r in launches]
    return result


def _print(res: dict) -> None:
    pr = res["per_request_ms"]
    print(f"pacer {res['setting']}: {res['requests']} requests; TTFT in the core p50 "
          f"{pr['ttft']['p50']:.2f} mean {pr['ttft']['mean']:.2f} p90 {pr['ttft']['p90']:.2f} ms")
    for k in ("wait", "lag", "device", "out", "idle_before"):
        s = pr[k]
        print(f"    {k:>11}: mean {s['mean']:.3f} p10 {s['p10']:.3f} p50 {s['p50']:.3f} "
              f"p90 {s['p90']:.3f} ms")
    print(f"    steps {res['steps']}; device ms decode {res['decode_device_ms']:.3f} mixed "
          f"{res['mixed_device_ms']:.3f}; idle before a step, mean ms: decode "
          f"{res['decode_idle_ms_mean']:.3f} mixed {res['mixed_idle_ms_mean']:.3f}; host launch "
          f"ms: decode {res['decode_launch_ms']:.3f} mixed {res['mixed_launch_ms']:.3f}")
    print("    runner host ms (decode / mixed): " + ", ".join(
        f"{k} {res[f'decode_{k}_ms']:.3f} / {res[f'mixed_{k}_ms']:.3f}" for k in PHASES) +
        f"; device clock / host clock {1 / res['clock_scale']:.7f}")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=str(REPO / "benchmarks/configs/llama-3-8b.json"),
                   help="a checkpoint folder or a config .json (dummy weights)")
    p.add_argument("--pacers", default="default",
                   help="comma-separated: off, default or MARGIN:FRACTION")
    p.add_argument("--rate", type=float, default=8.0)
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--min-input", type=int, default=180)
    p.add_argument("--max-input", type=int, default=220)
    p.add_argument("--min-output", type=int, default=162)
    p.add_argument("--max-output", type=int, default=198)
    p.add_argument("--vocab", type=int, default=128000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--prefill-graph-sizes", default=None,
                   help="comma-separated token counts to capture piecewise graphs at instead of "
                        "the default list")
    p.add_argument("--keep-steps", action="store_true", help="keep every launch in the output")
    p.add_argument("--cprofile", action="store_true",
                   help="profile the host work of the mixed steps' launches (cProfile)")
    p.add_argument("--out", default=None)
    ns = p.parse_args(argv)
    import torch
    if ns.prefill_graph_sizes:
        import peregrine.worker.worker as worker_mod
        sizes = sorted(int(x) for x in ns.prefill_graph_sizes.split(","))
        worker_mod.prefill_graph_sizes = lambda max_tokens: [s for s in sizes if s <= max_tokens]
    model = ns.model
    if model.endswith(".json"):
        from peregrine.bench.offline import model_folder
        model = model_folder(model)
    config = EngineConfig.from_args(EngineArgs(
        model=model, load_format="dummy", dtype=ns.dtype, skip_tokenizer_init=True,
        max_model_len=ns.max_model_len))
    core = EngineCore(config)
    runner = core.executor.worker.model_runner
    freeze_startup_heap()
    warm = argparse.Namespace(**{**vars(ns), "num_prompts": 16, "rate": 200.0})
    run_one(core, runner, warm, "warm", torch, 0)  # compile, autotune, the pacer's code paths
    results = []
    for i, setting in enumerate(ns.pacers.split(",")):
        res = run_one(core, runner, ns, setting.strip(), torch, i + 1)
        _print(res)
        if "cprofile_mixed" in res:
            print(res["cprofile_mixed"])
        results.append(res)
    core.shutdown()
    if ns.out:
        Path(ns.out).write_text(json.dumps(results))
    return {"results": results}


if __name__ == "__main__":
    main()
