"""Start-up time of `peregrine generate`: cold (empty Triton cache) and warm, and where it goes.

Each run is a fresh subprocess; its log lines are timestamped as they arrive. The engine logs one
"start-up phases (s):" line when it is ready (a core or worker process logs its own), which this
script parses: pre_engine (interpreter start-up and imports), import_torch, config, tokenizer,
and in engine_core/: device (CUDA context), attention_backend (imports triton), model (build +
weights), runner (step buffers), kv_profile (the worst-case step; a cold run compiles most
kernels there), kv_alloc, swap_space, precompile, decode_graphs,
piecewise_graphs, sampler_warmup, and each level's `other`. From the timestamps it adds
ready_s (the phases line), first_output_s and teardown_s (last output to exit). The import_time
run repeats the warm demo under `python -X importtime` and lists the slowest top-level imports.
Each run also lists what it added to Triton's cache (kernel variants by name, host modules).

Python bytecode, two ways (--bytecode): "installed" compiles the interpreter's standard library,
site-packages and peregrine ahead into a PYTHONPYCACHEPREFIX folder that the runs read (what
`pip install` leaves behind: it writes .pyc files at install time; the compile time is reported
apart, as install-time work), and "raw" points the runs at an empty prefix and writes nothing, so
every process compiles every module it imports from source (a site-packages without bytecode).
Each mode has its own empty Triton cache, so each has a cold run.

    python benchmarks/cold_start.py --out $OUT/cold_start.json
"""
from __future__ import annotations

import argparse
import json
import os
import re
import site
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from peregrine.startup_timing import LINE_PREFIX, parse_line  # noqa: E402  (no torch import)


def big_child(config: str) -> int:
    """Build an LLM on a config .json with dummy weights and decode 8 tokens; print the times."""
    import logging
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    t0 = time.perf_counter()
    import torch  # noqa: F401  (counted in the import time)

    from peregrine import LLM, SamplingParams
    from peregrine.entrypoints.model_path import model_folder
    t1 = time.perf_counter()
    llm = LLM(model=model_folder(config), load_format="dummy", skip_tokenizer_init=True,
              max_model_len=4096)
    t2 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": list(range(100, 228))}],
                       SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    t3 = time.perf_counter()
    print(f"Output: {len(out[0].outputs[0].token_ids)} tokens", flush=True)
    print(f"INFO import {t1 - t0:.2f} s, engine start {t2 - t1:.2f} s, first generate "
          f"{t3 - t2:.2f} s", flush=True)
    return 0


def run_once(args: list[str], env: dict[str, str], python_flags: tuple[str, ...] = ()) -> dict:
    cmd = ([sys.executable, *python_flags, __file__, *args] if args[0] == "--child-big"
           else [sys.executable, *python_flags, "-m", "peregrine.entrypoints.cli", *args])
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


def analyse(run: dict) -> None:
    """Add the parsed phases lines and the timestamps of readiness, first output and exit."""
    phases, ready, outputs = [], None, []
    for t, line in run["lines"]:
        parsed = parse_line(line)
        if parsed is not None:
            where = line.rsplit("[", 1)[1].rstrip("]") if line.endswith("]") else "engine"
            phases.append({"where": where, "at_s": t, "phases": parsed})
            if where == "engine":
                ready = t
        elif line.startswith("Output:"):
            outputs.append(t)
    run["phases"] = phases
    run["ready_s"] = ready
    run["first_output_s"] = outputs[0] if outputs else None
    run["teardown_s"] = round(run["wall_s"] - outputs[-1], 3) if outputs else None


def slowest_imports(lines: list[tuple[float, str]], top: int = 15) -> list[dict]:
    """The top-level imports (`python -X importtime`) with the largest cumulative time."""
    rows = []
    for _, line in lines:
        if not line.startswith("import time:") or "|" not in line:
            continue
        parts = line.split("|")
        name = parts[2]
        if name.strip() and not name.startswith("  "):  # depth 0: imported by our own code
            try:
                rows.append({"module": name.strip(), "cumulative_s": int(parts[1]) / 1e6})
            except ValueError:
                continue
    return sorted(rows, key=lambda r: -r["cumulative_s"])[:top]


def cache_files(cache: str) -> set[str]:
    return {str(p.relative_to(cache)) for p in Path(cache).rglob("*") if p.is_file()}


def new_compiles(before: set[str], after: set[str]) -> dict[str, int]:
    """What a run added to Triton's cache: kernel variants by name (one .json of metadata each
    beside its binary) and compiled host modules (.so: launchers, driver utilities)."""
    counts: dict[str, int] = {}
    for f in sorted(after - before):
        name = Path(f).name
        if name.endswith(".so"):
            counts["host_modules(.so)"] = counts.get("host_modules(.so)", 0) + 1
        elif name.endswith(".json") and not name.startswith("__grp__"):
            counts[name[:-5]] = counts.get(name[:-5], 0) + 1
    return counts


# What the start-up path imports (the CLI, the engine, a worker, the kernels, the tokenizer).
STARTUP_MODULES = ("peregrine.entrypoints.cli", "peregrine.entrypoints.llm",
                   "peregrine.engine.core_client", "peregrine.executor.uniproc",
                   "peregrine.executor.multiproc", "peregrine.worker.worker",
                   "peregrine.attention.triton_backend", "peregrine.tokenizer",
                   "tokenizers", "jinja2.sandbox", "triton")


def _site_roots() -> list[Path]:
    paths = sysconfig.get_paths()
    return sorted({Path(p) for p in (*site.getsitepackages(), paths["purelib"], paths["platlib"])})


def bytecode_dirs() -> list[str]:
    """The folders `pip install` compiles for what the start-up path imports: the standard
    library (the interpreter's install compiles it), peregrine, and every installed top-level
    package the start-up imports (pip compiles a package's every file, so modules imported
    lazily later are covered too)."""
    code = ("import importlib, json, sys\n"
            f"for m in {STARTUP_MODULES!r}:\n"
            "    try:\n        importlib.import_module(m)\n"
            "    except Exception:\n        pass\n"
            "print(json.dumps([getattr(m, '__file__', None) or '' "
            "for m in list(sys.modules.values())]))")
    files = json.loads(subprocess.run([sys.executable, "-c", code], check=True, text=True,
                                      capture_output=True, cwd=REPO,
                                      env={**os.environ, "PYTHONPATH": str(REPO)}).stdout)
    dirs = {sysconfig.get_paths()["stdlib"], str(REPO / "peregrine")}
    for f in filter(None, files):
        path = Path(f)
        for root in _site_roots():
            if root in path.parents:
                top = root / path.relative_to(root).parts[0]
                dirs.add(str(top if top.is_dir() else path))
    return sorted(dirs)


def compile_bytecode(prefix: str) -> dict:
    """Compile bytecode_dirs() into the PYTHONPYCACHEPREFIX `prefix` (many processes)."""
    dirs = bytecode_dirs()
    # NOTE: the standard library's folder may hold site-packages: leave it out of that walk,
    # its packages that the start-up imports are listed on their own.
    roots = _site_roots()
    inside = [d for d in dirs if any(r in Path(d).parents for r in roots)]
    outside = [d for d in dirs if d not in inside]
    skip = "|".join(re.escape(str(r)) for r in roots)
    t0 = time.perf_counter()
    rcs = []
    for args in (["-x", skip, *outside], inside):
        if args:
            rcs.append(subprocess.run(
                [sys.executable, "-m", "compileall", "-q", "-j", "0", *args],
                env={**os.environ, "PYTHONPYCACHEPREFIX": prefix}, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL).returncode)
    files = sum(1 for _ in Path(prefix).rglob("*.pyc"))
    # NOTE: compileall exits 1 when some file does not compile (test data written for
    # Python 2, templates); pip ignores those too.
    return {"dirs": dirs, "pyc_files": files, "seconds": round(time.perf_counter() - t0, 2),
            "rc": max(rcs)}


def report(r: dict) -> None:
    print(f"{r['case']:18s} {r['bytecode']:9s} {r['cache']:20s} rc={r['rc']} "
          f"{r['wall_s']:7.2f} s  ready "
          f"{r['ready_s']}  first output {r['first_output_s']}  teardown {r['teardown_s']}",
          flush=True)
    for p in r["phases"]:
        body = "  ".join(f"{k}={v:.2f}" for k, v in p["phases"].items())
        print(f"    [{p['where']}] {body}", flush=True)
    if r.get("compiled"):
        print("    compiled: " + "  ".join(f"{k} x{v}" for k, v in r["compiled"].items()),
              flush=True)
    for t, line in r["lines"]:
        if (("INFO" in line and LINE_PREFIX not in line) or "Output" in line or "rror" in line) \
                and not line.startswith("import time:"):
            print(f"    {t:7.2f}  {line[:160]}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="cold_start.json")
    p.add_argument("--prompt", default="def fibonacci(n):")
    p.add_argument("--big-config", default=str(REPO / "benchmarks/configs/llama-3-8b.json"),
                   help="a config .json served with dummy weights for the large-model row")
    p.add_argument("--skip-big", action="store_true")
    p.add_argument("--skip-import-time", action="store_true")
    p.add_argument("--only", default=None,
                   help="comma-separated cases to run (demo, demo_eager, demo_core_process, "
                        "llama-3-8b); the first of them in that order runs cold")
    p.add_argument("--bytecode", choices=("both", "installed", "raw"), default="both",
                   help="installed: bytecode compiled ahead, as pip does; raw: none, every "
                        "process compiles from source (both: every case installed, the first "
                        "case raw too)")
    p.add_argument("--child-big", default=None, help=argparse.SUPPRESS)
    ns = p.parse_args()
    if ns.child_big:
        return big_child(ns.child_big)
    demo = ["generate", ns.prompt]
    cases = [("demo", demo, ("cold", "warm")),
             ("demo_eager", [*demo, "--enforce-eager"], ("cold", "warm")),
             ("demo_core_process", [*demo, "--engine-core-process"], ("warm",))]
    if not ns.skip_big:
        cases.append(("llama-3-8b", ["--child-big", ns.big_config], ("cold", "warm")))
    if ns.only:
        wanted = ns.only.split(",")
        unknown = sorted(set(wanted) - {c[0] for c in cases})
        if unknown:
            p.error(f"--only: unknown case(s) {', '.join(unknown)}")
        cases = [c for c in cases if c[0] in wanted]
    modes = ["installed", "raw"] if ns.bytecode == "both" else [ns.bytecode]
    out: dict = {"python": sys.version.split()[0], "bytecode_compile": None, "runs": []}
    results = out["runs"]
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes:
            prefix = os.path.join(tmp, f"pycache-{mode}")
            os.makedirs(prefix)
            if mode == "installed":
                out["bytecode_compile"] = compile_bytecode(prefix)
                c = out["bytecode_compile"]
                print(f"bytecode compiled ahead (install-time work, not start-up): "
                      f"{c['pyc_files']} files in {c['seconds']} s into PYTHONPYCACHEPREFIX "
                      f"({', '.join(c['dirs'])})", flush=True)
            else:
                print("raw: an empty PYTHONPYCACHEPREFIX and PYTHONDONTWRITEBYTECODE=1: every "
                      "process compiles every module it imports", flush=True)
            cache = os.path.join(tmp, f"triton-{mode}")
            os.makedirs(cache)
            env = {**os.environ, "TRITON_CACHE_DIR": cache, "PYTHONUNBUFFERED": "1",
                   "PYTHONPYCACHEPREFIX": prefix, "PYTHONDONTWRITEBYTECODE": "1",
                   "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}"}
            # NOTE: under both, raw runs only the first case (cold and warm): the other cases
            # differ from it by the same per-process compile time.
            mode_cases = cases[:1] if mode == "raw" and len(modes) > 1 else cases
            for name, args, temps in mode_cases:
                for temp in temps:
                    if temp == "cold" and name != mode_cases[0][0]:
                        temp = "cold-for-new-kernels"  # the cache already holds the demo's kernels
                    before = cache_files(cache)
                    r = run_once(args, env)
                    r.update(case=name, bytecode=mode, cache=temp,
                             compiled=new_compiles(before, cache_files(cache)))
                    analyse(r)
                    results.append(r)
                    report(r)
            if not ns.skip_import_time and mode == modes[0]:
                r = run_once(demo, env, ("-X", "importtime"))
                r.update(case="demo_import_time", bytecode=mode, cache="warm")
                analyse(r)
                r["slowest_imports"] = slowest_imports(r["lines"])
                r["lines"] = [x for x in r["lines"] if not x[1].startswith("import time:")]
                results.append(r)
                report(r)
                for row in r["slowest_imports"]:
                    print(f"    import {row['module']:50s} {row['cumulative_s']:6.2f} s",
                          flush=True)
    Path(ns.out).write_text(json.dumps(out, indent=1))
    print(f"\n{'case':18s} {'bytecode':9s} {'triton cache':20s} {'wall':>7s} {'ready':>7s} "
          f"{'output':>7s} {'teardown':>8s}")
    for r in results:
        print(f"{r['case']:18s} {r['bytecode']:9s} {r['cache']:20s} {r['wall_s']:7.2f} "
              f"{r['ready_s'] or 0:7.2f} {r['first_output_s'] or 0:7.2f} {r['teardown_s'] or 0:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
