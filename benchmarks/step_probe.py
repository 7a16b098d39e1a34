"""How long does one engine step take with N requests decoding? Engine only, no HTTP.

Builds an in-process LLMEngine (default: Llama-3-8B architecture, dummy bf16 weights), adds N
requests of W3's shape (200 random prompt tokens, long outputs), runs until every request is
decoding, then times decode steps with the device synchronised after each one. The mean is the
step time the server's TPOT should approach at that concurrency; the host phases say where the
step's host time goes.

    python benchmarks/step_probe.py [--config benchmarks/configs/llama-3-8b.json] [--num-seqs 1000]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from peregrine.bench.offline import host_timings, model_folder  # noqa: E402
from peregrine.config import EngineArgs  # noqa: E402
from peregrine.engine.llm_engine import LLMEngine  # noqa: E402
from peregrine.sampling_params import SamplingParams  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default=str(REPO / "benchmarks/configs/llama-3-8b.json"))
    p.add_argument("--num-seqs", type=int, default=1000)
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--out", default=None)
    ns = p.parse_args()
    args = EngineArgs(model=model_folder(ns.config), load_format="dummy", dtype="bfloat16",
                      skip_tokenizer_init=True, max_model_len=1024,
                      max_num_seqs=max(256, ns.num_seqs))
    engine = LLMEngine.from_engine_args(args)
    rng = random.Random(0)
    sp = SamplingParams(max_tokens=1024 - ns.prompt_len, ignore_eos=True)
    for i in range(ns.num_seqs):
        engine.add_request(str(i), [rng.randrange(100, 128000) for _ in range(ns.prompt_len)], sp)
    sched = engine.core_client.core.scheduler
    while sched.waiting or any(r.num_output_tokens == 0 for r in sched.running):
        engine.step()
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    timings = host_timings(engine)
    for t in timings.values():
        t.clear()
    # Pipelined, as the server runs: host work of step N+1 overlaps the device's step N.
    t0 = time.perf_counter()
    for _ in range(ns.steps):
        engine.step()
    torch.cuda.synchronize()
    pipelined = (time.perf_counter() - t0) / ns.steps
    host = {f"{part}_{k}": round(v / ns.steps * 1e3, 3)
            for part, t in timings.items() for k, v in t.items()}
    # One step at a time (synchronised): its host and device work no longer overlap.
    times = []
    for _ in range(ns.steps):
        t0 = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    result = {"num_seqs": ns.num_seqs, "running": sched.num_running,
              "pipelined_step_ms": pipelined * 1e3,
              "synchronised_step_ms_median": statistics.median(times) * 1e3,
              "host_ms_per_step_pipelined": host}
    print(json.dumps(result, indent=1))
    if ns.out:
        Path(ns.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
