"""What the GPU runs between two decode CUDA graphs at batch 1: the draw, the copies, the next
step's inputs. A torch-profiler trace of one generation; each graph's kernels are found by their
launch (the `cudaGraphLaunch` they correlate with), so no kernel name is assumed.

    python benchmarks/step_gap_probe.py OUT.json [--temperature 0] -- --model \\
        benchmarks/configs/llama-3-8b.json [--quantization fp8]

The flags after `--` are `peregrine bench throughput`'s engine flags (dummy weights by default).
Prints, for the graphs after the first few, the gap from one graph's last kernel to the next
graph's first (µs), the work in the last such gap (a decode step's: µs after the graph's end,
duration, name), and the steps' time from graph start to graph start. (A prompt's first
graphs are the prefill's pieces, with its attention launched between them.)
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def graph_gaps(events: list[dict], skip: int = 5) -> dict:
    """From chrome-trace events: each graph launch's GPU span, the gaps between consecutive
    spans (µs) after `skip` graphs, the GPU work inside the last gap (between two decode
    steps: the prefill's pieces come first), and graph-start-to-start step times (ms)."""
    launches = {e["args"]["correlation"] for e in events
                if e.get("ph") == "X" and e.get("name") == "cudaGraphLaunch"
                and "correlation" in e.get("args", {})}
    gpu = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in _GPU_CATS),
                 key=lambda e: e["ts"])
    spans: dict[int, list[float]] = {}
    for e in gpu:
        c = e.get("args", {}).get("correlation")
        if c in launches:
            lo, hi = spans.setdefault(c, [e["ts"], e["ts"] + e["dur"]])
            spans[c] = [min(lo, e["ts"]), max(hi, e["ts"] + e["dur"])]
    ordered = sorted(spans.values())[skip:]
    gaps = [b[0] - a[1] for a, b in zip(ordered, ordered[1:])]
    between = []
    if len(ordered) > 1:
        (_, end), (start, _) = ordered[-2], ordered[-1]
        between = [{"at_us": round(e["ts"] - end, 1), "us": round(e["dur"], 1),
                    "name": e["name"][:100]}
                   for e in gpu if end <= e["ts"] < start
                   and e.get("args", {}).get("correlation") not in launches]
    return {"graphs": len(ordered), "gap_us": [round(g, 1) for g in gaps],
            "between_us": between,
            "step_ms": [round((b[0] - a[0]) / 1e3, 4) for a, b in zip(ordered, ordered[1:])]}


def main(argv: list[str]) -> None:
    if "--" not in argv:
        raise SystemExit(__doc__)
    cut = argv.index("--")
    own = argparse.ArgumentParser(prog="step_gap_probe.py")
    own.add_argument("out", help="where the JSON result goes")
    own.add_argument("--temperature", type=float, default=0.0,
                     help="0: greedy rows, as `bench latency` runs (default: %(default)s)")
    own.add_argument("--tokens", type=int, default=48,
                     help="tokens generated under the profiler (default: %(default)s)")
    args = own.parse_args(argv[:cut])
    import torch
    if not torch.cuda.is_available():
        raise SystemExit("step_gap_probe: needs a CUDA GPU")
    from torch.profiler import ProfilerActivity, profile

    from peregrine.bench.offline import _engine_args, build_parser
    from peregrine.entrypoints.llm import LLM
    from peregrine.sampling_params import SamplingParams

    ns = build_parser("throughput").parse_args(argv[cut + 1:])
    llm = LLM(**_engine_args(ns, max_model_len=1024))
    prompt = {"prompt_token_ids": list(range(1000, 1128))}
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=args.temperature,
                            seed=0)
    llm.generate([prompt], params, use_tqdm=False)  # warm-up
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate([prompt], params, use_tqdm=False)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        res = graph_gaps(json.loads(trace.read_text())["traceEvents"])
    res["temperature"] = args.temperature
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"{res['graphs']} graphs; gap us: {res['gap_us']}")
    for e in res["between_us"]:
        print(f"  {e['at_us']:8.1f} +{e['us']:6.1f}  {e['name']}")
    print(f"step ms: {res['step_ms']}")


if __name__ == "__main__":
    main(sys.argv[1:])
