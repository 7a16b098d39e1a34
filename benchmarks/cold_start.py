"""Start-up time of `peregrine generate`: cold (empty Triton cache) and warm, and where it goes.

Each run is a fresh subprocess; its log lines are timestamped as they arrive, so the gaps between
the engine's start-up messages (weights, memory profile, graph capture) show the phases. With
--import-time the child also reports its import time of torch and peregrine.

    python benchmarks/cold_start.py --out $OUT/cold_start.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def big_child(config: str) -> int:
    """Build an LLM on a config .json with dummy weights and decode 8 tokens; print the times."""
    t0 = time.perf_counter()
    import torch  # noqa: F401  (counted in the import time)

    from peregrine import LLM, SamplingParams
    from peregrine.entrypoints.model_path import model_folder
    t1 = time.perf_counter()
    llm = LLM(model=model_folder(config), load_format="dummy", skip_tokenizer_init=True,
              max_model_len=4096)
    t2 = time.perf_counter()
    llm.generate([{"prompt_token_ids": list(range(100, 228))}],
                 SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    t3 = time.perf_counter()
    print(f"INFO import {t1 - t0:.2f} s, engine start {t2 - t1:.2f} s, first generate "
          f"{t3 - t2:.2f} s", flush=True)
    return 0


def run_once(args: list[str], env: dict[str, str]) -> dict:
    cmd = ([sys.executable, __file__, *args] if args[0] == "--child-big"
           else [sys.executable, "-m", "peregrine.entrypoints.cli", *args])
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1)
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append((round(time.perf_counter() - t0, 3), line.rstrip()))
    rc = proc.wait()
    return {"cmd": " ".join(args), "rc": rc, "wall_s": round(time.perf_counter() - t0, 3),
            "lines": lines}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="cold_start.json")
    p.add_argument("--prompt", default="def fibonacci(n):")
    p.add_argument("--big-config", default=str(REPO / "benchmarks/configs/llama-3-8b.json"),
                   help="a config .json served with dummy weights for the large-model row")
    p.add_argument("--skip-big", action="store_true")
    p.add_argument("--child-big", default=None, help=argparse.SUPPRESS)
    ns = p.parse_args()
    if ns.child_big:
        return big_child(ns.child_big)
    results = []
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TRITON_CACHE_DIR": cache, "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}"}
        cases = [("demo", ["generate", ns.prompt])]
        cases.append(("demo_eager", ["generate", ns.prompt, "--enforce-eager"]))
        if not ns.skip_big:
            cases.append(("llama-3-8b", ["--child-big", ns.big_config]))
        for name, args in cases:
            for temp in ("cold", "warm"):
                if temp == "cold" and name != cases[0][0]:
                    temp = "cold-for-new-kernels"  # the cache already holds the demo's kernels
                r = run_once(args, env)
                r.update(case=name, cache=temp)
                results.append(r)
                print(f"{name:12s} {temp:22s} rc={r['rc']} {r['wall_s']:7.2f} s", flush=True)
                for t, line in r["lines"]:
                    if "INFO" in line or "Output" in line or "rror" in line:
                        print(f"    {t:7.2f}  {line[:160]}", flush=True)
    Path(ns.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
