"""Preemption by recompute vs by swap on a preemption-heavy offline workload, and a measurement
of the constants behind preemption_mode auto (kv_cache/swap_cost.py).

    python benchmarks/swap_bench.py --model benchmarks/configs/llama-3-8b.json \
        --output-json /tmp/out/swap.json
    python benchmarks/swap_bench.py --model benchmarks/configs/llama-3-8b.json --measure

The workload: --num-prompts random prompts of --input-len tokens, each generating --output-len
tokens (greedy, ignore_eos), all submitted at once to an engine whose KV cache is held to
--num-gpu-blocks blocks, so long outputs keep preempting each other. Each mode (recompute, swap,
auto) builds its own engine (dummy weights) and prints output tokens/s, preemptions and swaps.

--measure times, on the same engine, the device <-> CPU block copies (bandwidth, and the fixed
cost of a one-block swap) and a prefill (FLOP/s by the cost model's own count), then prints the
DeviceCosts those numbers give and the swap-or-recompute crossover they put the model at.
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODES = ("recompute", "swap", "auto")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _model_dir(model: str, tmp: Path) -> str:
    """A model folder: the path itself, or a folder holding a config.json given as a file."""
    path = Path(model)
    if path.is_dir():
        return str(path)
    folder = tmp / path.stem
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(path.read_text())
    return str(folder)


def _engine(model: str, ns: argparse.Namespace, mode: str, **extra: Any):
    from peregrine.config import EngineArgs
    from peregrine.engine.llm_engine import LLMEngine
    return LLMEngine.from_engine_args(EngineArgs(
        model=model, load_format="dummy", dtype=ns.dtype, skip_tokenizer_init=True,
        device=ns.device, max_model_len=ns.input_len + ns.output_len + 16, seed=0,
        num_gpu_blocks_override=ns.num_gpu_blocks, preemption_mode=mode,
        swap_space=ns.swap_space, enable_prefix_caching=False, **extra))


def _core(engine):
    return engine.core_client.core


def run_mode(model: str, ns: argparse.Namespace, mode: str) -> dict[str, Any]:
    """The workload on one engine; output tokens/s and the scheduler's preemption counters."""
    from peregrine.sampling_params import SamplingParams
    engine = _engine(model, ns, mode)
    rng = random.Random(0)
    vocab = engine.config.model.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(ns.input_len)] for _ in range(ns.num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=ns.output_len, ignore_eos=True)
    # Warm-up (first-call costs of the kernels and the allocator), not timed.
    engine.add_request("warmup", prompts[0][:16], SamplingParams(temperature=0.0, max_tokens=8))
    while engine.has_unfinished_requests():
        engine.step()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"swap-{mode}-{i}", prompt, params)
    _sync()
    t0 = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    _sync()
    elapsed = time.perf_counter() - t0
    sched = _core(engine).scheduler
    st = sched.make_stats()
    runner = _core(engine).executor.worker.model_runner
    block_bytes = runner.swap_space.block_bytes if runner.swap_space is not None else 0
    out = {"mode": mode, "seconds": elapsed, "steps": steps,
           "output_tokens_per_s": ns.num_prompts * ns.output_len / elapsed,
           "num_preemptions": st.num_preemptions, "num_swapped_out": st.num_swapped_out,
           "num_swapped_in": st.num_swapped_in, "num_gpu_blocks": sched.kv.num_blocks,
           "num_cpu_blocks": sched.kv.cpu_pool.num_blocks, "block_bytes": block_bytes}
    del engine, runner, sched
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def _timed(fn, iters: int) -> float:
    """Median seconds of fn() (synchronized), after one warm-up call."""
    fn()
    _sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def measure(model: str, ns: argparse.Namespace) -> dict[str, Any]:
    """Copy bandwidth, one-block swap cost and prefill FLOP/s on this machine."""
    from peregrine.kv_cache.swap_cost import DeviceCosts, SwapCostModel
    from peregrine.sampling_params import SamplingParams
    engine = _engine(model, ns, "swap")
    core = _core(engine)
    space = core.executor.worker.model_runner.swap_space
    cost: SwapCostModel = core.config.scheduler.swap_cost
    n = min(ns.measure_blocks, space.num_cpu_blocks, core.scheduler.kv.num_blocks)
    blocks = [(i, i) for i in range(n)]
    t_out = _timed(lambda: space.swap_out(blocks), ns.iters)
    t_in = _timed(lambda: space.swap_in(blocks), ns.iters)
    t_one = (_timed(lambda: space.swap_out([(0, 0)]), ns.iters)
             + _timed(lambda: space.swap_in([(0, 0)]), ns.iters)) / 2
    bandwidth = 2 * n * space.block_bytes / (t_out + t_in)
    rng = random.Random(1)
    vocab = engine.config.model.vocab_size
    length = ns.input_len
    params = SamplingParams(temperature=0.0, max_tokens=1)
    count = [0]

    def prefill() -> None:
        count[0] += 1
        engine.add_request(f"prefill-{count[0]}", [rng.randrange(vocab) for _ in range(length)],
                           params)
        while engine.has_unfinished_requests():
            engine.step()
    t_prefill = _timed(prefill, ns.iters)
    flops = cost.recompute_seconds(length) * cost.device.flops_per_s  # the model's FLOP count
    launches = 4 * cost.num_layers * cost.device.copy_launch_s
    measured = DeviceCosts(copy_bandwidth=bandwidth, flops_per_s=flops / t_prefill,
                           fixed_s=max(0.0, t_one - launches - space.block_bytes / bandwidth),
                           copy_launch_s=cost.device.copy_launch_s)
    remeasured = SwapCostModel(**{**cost.__dict__, "device": measured})
    return {"blocks_copied": n, "block_bytes": space.block_bytes,
            "swap_out_GBps": n * space.block_bytes / t_out / 1e9,
            "swap_in_GBps": n * space.block_bytes / t_in / 1e9,
            "one_block_swap_us": t_one * 1e6, "prefill_tokens": length,
            "prefill_s": t_prefill, "prefill_TFLOPs": flops / t_prefill / 1e12,
            "constants_in_use": cost.device.__dict__, "measured": measured.__dict__,
            "crossover_tokens_in_use": cost.crossover_tokens(),
            "crossover_tokens_measured": remeasured.crossover_tokens()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="benchmarks/configs/llama-3-8b.json",
                   help="a config.json (dummy weights) or a model folder")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="auto")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=1536)
    p.add_argument("--num-gpu-blocks", type=int, default=2048,
                   help="KV blocks of 16 tokens (2048: 32k tokens for 64 x 2k-token requests)")
    p.add_argument("--swap-space", type=float, default=16.0, help="GiB")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--measure", action="store_true", help="measure the auto rule's constants")
    p.add_argument("--measure-blocks", type=int, default=256)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--output-json", default=None)
    ns = p.parse_args(argv)
    modes = [m for m in ns.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        p.error(f"unknown modes {bad} (expected {', '.join(MODES)})")
    results: dict[str, Any] = {"args": vars(ns)}
    with tempfile.TemporaryDirectory() as tmp:
        model = _model_dir(ns.model, Path(tmp))
        if ns.measure:
            results["measure"] = m = measure(model, ns)
            print(json.dumps(m, indent=2))
        else:
            results["runs"] = []
            for mode in modes:
                r = run_mode(model, ns, mode)
                results["runs"].append(r)
                print(f"{mode:>9}: {r['output_tokens_per_s']:10.1f} output tok/s  "
                      f"{r['seconds']:8.2f} s  {r['steps']:6d} steps  preemptions "
                      f"{r['num_preemptions']:5d}  swapped out/in {r['num_swapped_out']}/"
                      f"{r['num_swapped_in']}", flush=True)
    if ns.output_json:
        out = Path(ns.output_json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
