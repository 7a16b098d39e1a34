"""What each executor backend adds to a step: decode steps of a small model, where the device's
work is short and the executor's broadcast and collection show.

    python benchmarks/executor_overhead.py --backends mp ray -tp 2 --json /tmp/out/executors.json

For each backend it builds an engine (a tiny random-weight Qwen3-architecture checkpoint, float32,
greedy), generates --num-seqs sequences of --output-len tokens once to warm up, then times the
same run again and reports the mean step time (decode steps dominate: prompts are 16 tokens) and
output tokens/s. `uni` (one in-process worker, tensor_parallel_size 1) is the floor to compare
with. Exits 1 if the tensor-parallel backends' greedy tokens differ. The ray backend starts a local Ray instance unless one is running (`ray start --head`).
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _checkpoint(out: Path) -> str:
    from peregrine.testing.checkpoints import build_tiny_checkpoint
    return str(build_tiny_checkpoint(out, "qwen3", dtype=torch.float32, hidden_size=256,
                                     head_dim=64, num_attention_heads=4, num_key_value_heads=2,
                                     intermediate_size=512, num_hidden_layers=2,
                                     max_position_embeddings=1024))


def _run(path: str, backend: str, tp: int, args: argparse.Namespace) -> dict:
    from peregrine import LLM, SamplingParams
    engine = dict(dtype="float32", max_model_len=512, num_gpu_blocks_override=512,
                  device=args.device)
    if backend != "uni":
        engine.update(tensor_parallel_size=tp, distributed_executor_backend=backend)
    prompts = [[(7 * i + j) % 400 + 20 for i in range(16)] for j in range(args.num_seqs)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    t0 = time.perf_counter()
    llm = LLM(path, **engine)
    start_s = time.perf_counter() - t0
    try:
        llm.generate(prompts, params, use_tqdm=False)  # warm-up
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        tokens = [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.engine.shutdown()
        del llm
        gc.collect()
    # NOTE: one step per output token (the prompts fit one step), so steps = output_len.
    return {"backend": backend, "tensor_parallel_size": tp if backend != "uni" else 1,
            "start_s": round(start_s, 2), "elapsed_s": round(elapsed, 4),
            "step_ms": round(1e3 * elapsed / args.output_len, 3),
            "output_tok_per_s": round(args.num_seqs * args.output_len / elapsed, 1),
            "tokens": tokens}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", nargs="+", default=["mp", "ray"], choices=["mp", "ray"])
    p.add_argument("-tp", "--tensor-parallel-size", type=int, default=2)
    p.add_argument("--num-seqs", type=int, default=8)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--device", default="auto")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.tensor_parallel_size < 1 or args.num_seqs < 1 or args.output_len < 1:
        p.error("--tensor-parallel-size, --num-seqs and --output-len must be >= 1")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = _checkpoint(Path(tmp) / "ckpt")
        for backend in ["uni", *args.backends]:
            row = _run(path, backend, args.tensor_parallel_size, args)
            rows.append(row)
            print(f"{backend:>4}: start {row['start_s']:6.1f} s, step {row['step_ms']:7.3f} ms, "
                  f"{row['output_tok_per_s']:9.1f} output tok/s", flush=True)
    # NOTE: the tensor-parallel backends run the same ranks with the same reductions, so their
    # tokens must be identical; against one worker, float32 rounding may rarely flip a near-tie.
    parallel = [r["tokens"] for r in rows[1:]]
    same = all(t == parallel[0] for t in parallel)
    as_uni = all(t == rows[0]["tokens"] for t in parallel)
    print(f"greedy tokens identical across {', '.join(args.backends)}: {same}; "
          f"equal to one worker's: {as_uni}")
    result = {"device": args.device if args.device != "auto" else (
        "cuda" if torch.cuda.is_available() else "cpu"),
              "num_seqs": args.num_seqs, "output_len": args.output_len,
              "tokens_identical": same, "tokens_equal_to_uni": as_uni,
              "rows": [{k: v for k, v in r.items() if k != "tokens"} for r in rows]}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
