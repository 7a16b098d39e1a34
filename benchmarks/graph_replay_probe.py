"""Is batch-1 decode bound by the GPU's work or by the host? Time per token in the engine
against its batch-1 decode CUDA graph (model and LM head) replayed back to back, in one process,
and the kernels of one replay (torch profiler; a dependent kernel's time includes its wait for
the kernel ahead).

    python benchmarks/graph_replay_probe.py OUT.json -- --model benchmarks/configs/llama-3-8b.json \\
        [--quantization fp8]

The flags after `--` are `peregrine bench throughput`'s engine flags (dummy weights by default).
The engine's time per token is that of a 257-token generation less a 1-token one, over 256, so
the prompt's prefill and the set-up cancel; twice.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from peregrine.bench.offline import _engine_args, build_parser  # noqa: E402
from peregrine.entrypoints.llm import LLM  # noqa: E402
from peregrine.sampling_params import SamplingParams  # noqa: E402

REPLAYS = 200


def _generate_s(llm: LLM, prompt: dict, tokens: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=tokens, ignore_eos=True), use_tqdm=False)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[1] != "--":
        raise SystemExit(__doc__)
    if not torch.cuda.is_available():
        raise SystemExit("graph_replay_probe: needs a CUDA GPU")
    out = Path(argv[0])
    ns = build_parser("throughput").parse_args(argv[2:])
    llm = LLM(**_engine_args(ns, max_model_len=1024))
    prompt = {"prompt_token_ids": list(range(1000, 1128))}
    _generate_s(llm, prompt, 16)  # warm-up
    res: dict = {"engine_ms_per_token": [
        (_generate_s(llm, prompt, 257) - _generate_s(llm, prompt, 1)) / 256 * 1e3
        for _ in range(2)]}
    runner = llm.engine.core_client.core.executor.worker.model_runner
    graph = runner.graphs.graphs[1]  # the inputs of the last decode step are still in place
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    res["graph_ms"] = start.elapsed_time(end) / REPLAYS
    print(json.dumps(res))
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
    kernels = sorted(((e.key, e.device_time_total / 5, e.count / 5)
                      for e in prof.key_averages() if e.device_time_total > 0),
                     key=lambda row: -row[1])
    res["kernels_us_per_replay"] = [{"name": n, "us": us, "count": c} for n, us, c in kernels]
    for name, us, count in kernels:
        print(f"{us:9.1f} us {count:6.1f} x  {name[:100]}")
    out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
