"""Serving workloads W3 and W4 on a GPU: start `peregrine serve`, run `peregrine bench serve`.

W3: Llama-3-8B architecture, dummy bf16 weights, 1000 requests, prompts 180..220 tokens and
    outputs 162..198 tokens (uniform, --random-range-ratio 0.1 around 200 / 180), at rate inf
    and a few finite Poisson rates.
W4: a 2,000-token prefix shared by all requests + a 100-token unique part: TTFT with prefix
    caching on vs off (finite rate), and throughput at 0% hits (unique 2,100-token prompts, rate
    inf) with caching on vs off.

    python benchmarks/serve_workloads.py w3          # --config benchmarks/configs/llama-3-8b.json
    python benchmarks/serve_workloads.py w4 --out-dir bench-results/serve

Each run writes OUT_DIR/<name>.json (the bench summary) and prints one table at the end.
Needs the `serve` extra (fastapi, uvicorn, pydantic, prometheus-client) on the GPU machine that
serves; the client side is stdlib only. Set PEREGRINE_BENCH_DTYPE=float32 for a CPU dry run on a tiny config.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # NOTE: the bench client runs in-process: this checkout's code


def _wait_healthy(port: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError("server did not become healthy in time")


class Server:
    """`peregrine serve CONFIG` as a subprocess (logs to OUT_DIR/server-<name>.log)."""

    def __init__(self, config: str, port: int, log: Path, extra: list[str]) -> None:
        cmd = [sys.executable, "-m", "peregrine.entrypoints.cli", "serve", config, "--port",
               str(port), "--dtype", os.environ.get("PEREGRINE_BENCH_DTYPE", "bfloat16"), "--load-format", "dummy",
               "--log-stats-interval", "10", *extra]
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.log = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.port = port

    def __enter__(self) -> Server:
        _wait_healthy(self.port, self.proc, timeout=600)
        return self

    def __exit__(self, *exc) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


# NOTE: token ids are drawn below this (Llama 3's special tokens start at 128000); --vocab-size.
_VOCAB = ["128000"]


def _bench(port: int, out: Path, name: str, args: list[str]) -> dict:
    from peregrine.bench.serve import main as bench_main
    path = out / f"{name}.json"
    bench_main(["--base-url", f"http://127.0.0.1:{port}", "--vocab-size", _VOCAB[0],
                "--save-detailed", "--label", name, "--result-file", str(path), *args])
    return json.loads(path.read_text())["summary"]  # includes the server-side means


def _warmup(port: int, out: Path) -> None:
    _bench(port, out, "warmup", ["--num-prompts", "32", "--random-input-len", "64",
                                 "--random-output-len", "16"])


def run_w3(ns: argparse.Namespace, out: Path) -> dict[str, dict]:
    results = {}
    extra = ["--max-model-len", "1024", *ns.server_args.split()]
    with Server(ns.config, ns.port, out / f"server-w3{ns.tag}.log", extra):
        _warmup(ns.port, out)
        for rate in ns.rates.split(","):
            name = f"w3{ns.tag}_rate_{rate}"
            results[name] = _bench(ns.port, out, name, [
                "--dataset", "random", "--num-prompts", str(ns.num_prompts), "--request-rate",
                rate, "--random-input-len", "200", "--random-output-len", "180",
                "--random-range-ratio", "0.1", "--seed", "0"])
    return results


def run_w4(ns: argparse.Namespace, out: Path) -> dict[str, dict]:
    results = {}
    for caching in ns.w4_caching.split(","):
        flag = "--enable-prefix-caching" if caching == "on" else "--no-enable-prefix-caching"
        with Server(ns.config, ns.port, out / f"server-w4-{caching}.log",
                    ["--max-model-len", "4096", flag]):
            _warmup(ns.port, out)
            results[f"w4_shared_prefix_caching_{caching}"] = _bench(
                ns.port, out, f"w4_shared_prefix_caching_{caching}", [
                    "--dataset", "prefix-shared", "--num-prompts", str(ns.w4_prompts),
                    "--request-rate", ns.w4_rate, "--prefix-len", "2000", "--suffix-len", "100",
                    "--output-len", "100", "--seed", "1"])
            if ns.w4_no_zero_hits:
                continue
            results[f"w4_zero_hits_caching_{caching}"] = _bench(
                ns.port, out, f"w4_zero_hits_caching_{caching}", [
                    "--dataset", "random", "--num-prompts", str(ns.w4_prompts),
                    "--request-rate", "inf", "--random-input-len", "2100",
                    "--random-output-len", "100", "--random-range-ratio", "0", "--seed", "2"])
    return results


def _table(results: dict[str, dict]) -> str:
    rows = ["| run | ok/failed | req/s | out tok/s | total tok/s | TTFT mean/p50/p99 ms "
            "| TPOT mean/p50/p99 ms | ITL p50/p99 ms | E2E p50/p99 ms |", "|" + "---|" * 9]
    for name, s in results.items():
        t, p, i, e = s["ttft_ms"], s["tpot_ms"], s["itl_ms"], s["e2el_ms"]
        rows.append(f"| {name} | {s['successful_requests']}/{s['failed_requests']} "
                    f"| {s['request_throughput']:.2f} | {s['output_throughput']:.0f} "
                    f"| {s['total_token_throughput']:.0f} "
                    f"| {t['mean']:.1f}/{t['median']:.1f}/{t['p99']:.1f} "
                    f"| {p['mean']:.1f}/{p['median']:.1f}/{p['p99']:.1f} "
                    f"| {i['median']:.1f}/{i['p99']:.1f} | {e['median']:.0f}/{e['p99']:.0f} |")
    rows += ["", "| run | client TTFT mean ms | server TTFT mean ms | queue mean ms "
             "| prefill mean ms | decode mean ms |", "|" + "---|" * 6]
    for name, s in results.items():
        v = s.get("server", {})

        def ms(key: str) -> str:
            return "-" if v.get(key) is None else f"{v[key]:.1f}"
        rows.append(f"| {name} | {s['ttft_ms']['mean']:.1f} | {ms('time_to_first_token_mean_ms')} "
                    f"| {ms('request_queue_time_mean_ms')} | {ms('request_prefill_time_mean_ms')} "
                    f"| {ms('request_decode_time_mean_ms')} |")
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("workload", choices=["w3", "w4", "all"])
    p.add_argument("--config", default=str(REPO / "benchmarks/configs/llama-3-8b.json"))
    p.add_argument("--port", type=int, default=8011)
    p.add_argument("--out-dir", default="bench-results/serve")
    p.add_argument("--num-prompts", type=int, default=1000, help="W3 requests per rate")
    p.add_argument("--rates", default="inf,8,16,32", help="W3 request rates (comma-separated)")
    p.add_argument("--w4-prompts", type=int, default=200)
    p.add_argument("--w4-rate", default="4", help="W4 shared-prefix TTFT run: requests/s")
    p.add_argument("--w4-caching", default="on,off", help="W4 prefix caching settings to run")
    p.add_argument("--w4-no-zero-hits", action="store_true", help="skip W4's 0%%-hit runs")
    p.add_argument("--vocab-size", default=None, help="prompt token ids are drawn below this "
                   "(default: the config's vocab_size, at most 128000)")
    p.add_argument("--server-args", default="", help="extra `peregrine serve` flags for W3 "
                   "(e.g. \"--max-num-seqs 1024\")")
    p.add_argument("--tag", default="", help="suffix of W3's result names (e.g. _seqs1024)")
    ns = p.parse_args()
    _VOCAB[0] = ns.vocab_size or str(min(128000, json.loads(Path(ns.config).read_text())
                                         .get("vocab_size", 128000)))
    out = Path(ns.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    if ns.workload in ("w3", "all"):
        results.update(run_w3(ns, out))
    if ns.workload in ("w4", "all"):
        results.update(run_w4(ns, out))
    (out / f"summary-{ns.workload}.json").write_text(json.dumps(results, indent=2))
    print(_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
