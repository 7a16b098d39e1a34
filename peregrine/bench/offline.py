"""`peregrine bench throughput` (W1) and `peregrine bench latency` (W2), optionally beside transformers.

NOTE: torch is imported inside the functions that run a benchmark, so building the parser (and
`--help`) stays cheap.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

from peregrine.config import EngineArgs
from peregrine.entrypoints.cli import add_engine_args, engine_args_from
from peregrine.entrypoints.model_path import model_folder
from peregrine.sampling_params import SamplingParams


# Prompt token ids are drawn from [0, 10000] (fewer for a smaller vocabulary).
MAX_PROMPT_TOKEN_ID = 10000


def _max_token_id(vocab_size: int) -> int:
    return min(MAX_PROMPT_TOKEN_ID, vocab_size - 1)


def w1_requests(num: int, seed: int, min_in: int, max_in: int, min_out: int, max_out: int,
                max_token_id: int = MAX_PROMPT_TOKEN_ID) -> tuple[list[list[int]], list[int]]:
    """W1: all prompts first, then all output lengths, from Python's random after seed()."""
    random.seed(seed)
    prompts = [[random.randint(0, max_token_id) for _ in range(random.randint(min_in, max_in))]
               for _ in range(num)]
    out_lens = [random.randint(min_out, max_out) for _ in range(num)]
    return prompts, out_lens


def run_throughput(ns: argparse.Namespace) -> dict[str, Any]:
    from peregrine.entrypoints.llm import LLM
    args = _engine_args(ns, max_model_len=ns.max_input + ns.max_output)
    llm = LLM(**args)
    prompts, out_lens = w1_requests(ns.num_prompts, ns.seed, ns.min_input, ns.max_input,
                                    ns.min_output, ns.max_output,
                                    _max_token_id(llm.engine.config.model.vocab_size))
    params = [SamplingParams(temperature=ns.temperature, max_tokens=n, ignore_eos=True, seed=i,
                             detokenize=ns.detokenize)
              for i, n in enumerate(out_lens)]
    # Warm-up: a few short requests so compilation and autotuning stay out of the timing.
    warm = prompts[:4]
    llm.generate(warm, [SamplingParams(max_tokens=min(8, ns.max_output), ignore_eos=True)]
                 * len(warm), use_tqdm=False)
    _sync()
    t0 = time.perf_counter()
    timings = host_timings(llm.engine)
    for t in timings.values():
        t.clear()
    if ns.torch_profile:
        _profile_steps(llm.engine, ns.torch_profile, ns.torch_profile_out)
    spec_before = llm.engine.get_stats()
    outs = llm.generate(prompts, params, use_tqdm=False)
    _sync()
    elapsed = time.perf_counter() - t0
    profile = {f"{part}_{k}": v for part, t in timings.items() for k, v in t.items()}
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    in_tokens = sum(len(p) for p in prompts)
    result = {"engine": "peregrine", "workload": "W1", "requests": len(prompts),
              "prompt_tokens": in_tokens, "output_tokens": out_tokens, "elapsed_s": elapsed,
              "output_tokens_per_s": out_tokens / elapsed,
              "total_tokens_per_s": (in_tokens + out_tokens) / elapsed,
              "detokenize": ns.detokenize,
              "engine_args": {k: v for k, v in args.items() if k != "model"},
              "host_profile_s": profile}
    if llm.engine.config.speculative is not None:
        result["speculative"] = spec_decode_report(spec_before, llm.engine.get_stats())
    del llm
    if ns.compare_transformers:
        result["transformers"] = _hf_continuous_batching(ns, prompts, out_lens)
    return result


def host_timings(engine) -> dict[str, dict[str, float]]:
    """Cumulative host seconds per phase of an in-process engine: front end, core, runner."""
    core = engine.core_client.core
    worker = getattr(core.executor, "worker", None)  # None: the runners are in worker processes
    return {"engine": engine.timing, "core": core.timing,
            "runner": worker.model_runner.timing if worker is not None else {}}


def _profile_steps(engine, window: str, out_path: str | None) -> None:
    """Wrap engine.step so that steps [a, b) run under torch.profiler; print the top kernels."""
    import torch
    a, b = (int(x) for x in window.split(":"))
    original = engine.step
    state = {"n": 0, "prof": None}

    def step():
        n = state["n"]
        if n == a:
            state["prof"] = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
            state["prof"].__enter__()
        result = original()
        state["n"] = n + 1
        if n + 1 == b and state["prof"] is not None:
            _sync()
            state["prof"].__exit__(None, None, None)
            table = state["prof"].key_averages().table(sort_by="cuda_time_total", row_limit=40)
            cpu_table = state["prof"].key_averages().table(sort_by="cpu_time_total", row_limit=40)
            text = f"steps {a}..{b}\n{table}\n{cpu_table}"
            print(table)
            if out_path:
                Path(out_path).write_text(text)
            state["prof"] = None
        return result

    engine.step = step


def _hf_continuous_batching(ns, prompts, out_lens) -> dict[str, Any]:
    """transformers' generate_batch with paged attention on the first --hf-requests requests."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.generation import GenerationConfig
    n = min(ns.hf_requests, len(prompts))
    cfg = AutoConfig.from_pretrained(_model_dir(ns))
    res: dict[str, Any] = {"engine": "transformers generate_batch", "requests": n}
    for impl in ("paged|sdpa", "sdpa_paged"):
        try:
            with torch.device("cuda"):  # random init on the GPU: seconds, not minutes
                model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16,
                                                         attn_implementation=impl)
            break
        except Exception as e:  # noqa: BLE001 - try the other spelling
            res[f"error_{impl}"] = repr(e)[:200]
    else:
        return res
    model = model.cuda().eval()
    res["attn_implementation"] = impl
    total = 0
    t0 = time.perf_counter()
    gen = GenerationConfig(max_new_tokens=max(out_lens[:n]), do_sample=True, temperature=ns.temperature,
                           eos_token_id=-1, pad_token_id=0)
    outs = model.generate_batch(inputs=prompts[:n], generation_config=gen, progress_bar=False)
    _sync()
    elapsed = time.perf_counter() - t0
    for o in outs.values():
        total += len(getattr(o, "generated_tokens", []) or [])
    res.update(output_tokens=total, elapsed_s=elapsed, output_tokens_per_s=total / elapsed,
               note="every request runs to the longest output length (one max_new_tokens per batch)")
    return res


def run_latency(ns: argparse.Namespace) -> dict[str, Any]:
    import torch

    from peregrine.engine.llm_engine import LLMEngine
    args = _engine_args(ns, max_model_len=ns.input_len + ns.output_len + 16)
    engine = LLMEngine.from_engine_args(EngineArgs(**args))
    random.seed(ns.seed)
    top = _max_token_id(engine.config.model.vocab_size)
    prompt = [random.randint(0, top) for _ in range(ns.input_len)]
    params = SamplingParams(temperature=0.0, max_tokens=ns.output_len, ignore_eos=True)
    runs = []
    spec_before = engine.get_stats()
    for it in range(ns.warmup + ns.iters):
        if it == ns.warmup:
            spec_before = engine.get_stats()
        engine.add_request(f"lat-{it}", prompt, params)
        _sync()
        t0 = time.perf_counter()
        first = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if first is None and out.outputs[0].token_ids:
                    first = time.perf_counter()
        _sync()
        end = time.perf_counter()
        if it >= ns.warmup:
            runs.append((first - t0, end - first, end - t0))
    ttft = sorted(r[0] for r in runs)[len(runs) // 2]
    decode = sorted(r[1] for r in runs)[len(runs) // 2]
    tps = (ns.output_len - 1) / decode
    mc = engine.config.model
    # NOTE: summed over the ranks; the bandwidth ceiling over the tensor-parallel ranks only: each
    # GPU of a stage reads its own shard every step, and one request's token passes the pipeline
    # stages one after another.
    weight_bytes = engine.core_client.core.executor.weight_bytes
    kv_per_token = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * torch.empty((), dtype=mc.dtype).element_size()
    avg_ctx = ns.input_len + ns.output_len / 2
    bytes_per_token = weight_bytes + kv_per_token * avg_ctx
    result = {"engine": "peregrine", "workload": "W2", "input_len": ns.input_len,
              "output_len": ns.output_len, "ttft_s": ttft, "decode_s": decode,
              "decode_tokens_per_s": tps, "end_to_end_tokens_per_s": ns.output_len / (ttft + decode),
              "weight_bytes": weight_bytes, "achieved_GBps": bytes_per_token * tps / 1e9,
              "hbm_ceiling_GBps": 4200.0 * engine.config.tensor_parallel_size,
              "tensor_parallel_size": engine.config.tensor_parallel_size,
              "pipeline_parallel_size": engine.config.pipeline_parallel_size}
    if engine.config.speculative is not None:
        result["speculative"] = spec_decode_report(spec_before, engine.get_stats())
    del engine
    if ns.compare_transformers:
        result["transformers"] = _hf_generate_latency(ns, prompt)
    return result


def spec_decode_report(before, after) -> dict[str, Any]:
    """Speculative decoding between two EngineStats: drafts, acceptance rate, mean acceptance
    length (tokens a verify step emits per request)."""
    drafts = after.spec_num_drafts - before.spec_num_drafts
    proposed = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    return {"num_drafts": drafts, "draft_tokens": proposed, "accepted_tokens": accepted,
            "acceptance_rate": accepted / proposed if proposed else 0.0,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else 0.0}


def _hf_generate_latency(ns, prompt) -> dict[str, Any]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.from_pretrained(_model_dir(ns))
    with torch.device("cuda"):  # random init on the GPU: seconds, not minutes
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    ids = torch.tensor([prompt], device="cuda")
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, eos_token_id=-1, pad_token_id=0)
    model.generate(ids, max_new_tokens=8, **kw)
    _sync()
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=ns.output_len, min_new_tokens=ns.output_len, **kw)
    _sync()
    elapsed = time.perf_counter() - t0
    return {"engine": "transformers generate", "elapsed_s": elapsed,
            "tokens_per_s": ns.output_len / elapsed}


def _model_dir(ns: argparse.Namespace) -> str:
    """--model as a folder: a config .json becomes a weightless folder (removed at exit), a hub
    id its local snapshot."""
    if ns.model.endswith(".json"):
        return model_folder(ns.model)
    from peregrine.hub import resolve_model_path
    return resolve_model_path(ns.model, ns.revision, ns.download_dir)


def _engine_args(ns: argparse.Namespace, max_model_len: int) -> dict[str, Any]:
    """The engine flags as LLM's keyword arguments: token-id prompts, the workload's length."""
    args = dataclasses.asdict(engine_args_from(ns))
    args.update(model=_model_dir(ns), skip_tokenizer_init=True, max_model_len=max_model_len)
    return args


def _sync() -> None:
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# Engine flags a benchmark sets itself (the workload's lengths, token-id prompts, in process).
_ENGINE_ARGS_SET_BY_BENCH = frozenset({"model", "max_model_len", "skip_tokenizer_init", "tokenizer",
                                       "served_model_name", "engine_core_process"})


def add_cli_args(p: argparse.ArgumentParser, kind: str) -> None:
    """The flags of `peregrine bench throughput` / `latency`: the engine's, then the workload's."""
    if kind not in ("throughput", "latency"):
        raise ValueError(f"unknown offline benchmark {kind!r} (expected throughput or latency)")
    p.add_argument("--model", required=True,
                   help="model folder, Hugging Face id, or a config .json served with dummy "
                   "weights (e.g. benchmarks/configs/qwen3-0.6b.json)")
    add_engine_args(p, skip=_ENGINE_ARGS_SET_BY_BENCH)
    # NOTE: benchmarks measure the serving configuration: random weights in bfloat16.
    p.set_defaults(load_format="dummy", dtype="bfloat16")
    p.add_argument("--compare-transformers", action=argparse.BooleanOptionalAction, default=False,
                   help="also run transformers on the same requests, on CUDA "
                   "(default: %(default)s)")
    p.add_argument("--output-json", default=None,
                   help="write the result as JSON to this file (default: %(default)s, print only)")
    if kind == "throughput":
        p.add_argument("--num-prompts", type=int, default=256,
                       help="requests (default: %(default)s)")
        p.add_argument("--min-input", type=int, default=100,
                       help="shortest prompt in tokens (default: %(default)s)")
        p.add_argument("--max-input", type=int, default=1024,
                       help="longest prompt in tokens (default: %(default)s)")
        p.add_argument("--min-output", type=int, default=100,
                       help="shortest output in tokens (default: %(default)s)")
        p.add_argument("--max-output", type=int, default=1024,
                       help="longest output in tokens (default: %(default)s)")
        p.add_argument("--temperature", type=float, default=0.6,
                       help="sampling temperature (default: %(default)s)")
        p.add_argument("--detokenize", action=argparse.BooleanOptionalAction, default=True,
                       help="turn the outputs into text as a user's would be; --no-detokenize "
                       "times token ids only (default: %(default)s)")
        p.add_argument("--hf-requests", type=int, default=32,
                       help="requests run by transformers with --compare-transformers "
                       "(default: %(default)s)")
        p.add_argument("--torch-profile", default=None, metavar="A:B",
                       help="run engine steps A..B-1 under torch.profiler and print the top "
                       "kernels (default: %(default)s, no profile)")
        p.add_argument("--torch-profile-out", default=None,
                       help="also write the profile tables to this file (default: %(default)s)")
    else:
        p.add_argument("--input-len", type=int, default=128,
                       help="prompt tokens (default: %(default)s)")
        p.add_argument("--output-len", type=int, default=256,
                       help="output tokens (default: %(default)s)")
        p.add_argument("--warmup", type=int, default=1,
                       help="untimed runs first (default: %(default)s)")
        p.add_argument("--iters", type=int, default=3,
                       help="timed runs; the medians are reported (default: %(default)s)")


def build_parser(kind: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"peregrine bench {kind}")
    add_cli_args(p, kind)
    return p


def run(kind: str, ns: argparse.Namespace) -> int:
    """Run the parsed benchmark, print its table (and JSON); returns the exit code."""
    import torch
    try:
        result = run_throughput(ns) if kind == "throughput" else run_latency(ns)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result["torch"] = torch.__version__
    try:
        import triton
        result["triton"] = triton.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        result["gpu"] = torch.cuda.get_device_name()
    _print_table(result)
    if ns.output_json:
        Path(ns.output_json).write_text(json.dumps(result, indent=2))
    return 0


def main(kind: str, argv: list[str]) -> int:
    """Entry point of `peregrine bench throughput|latency`; returns the exit code."""
    return run(kind, build_parser(kind).parse_args(argv))


def _print_table(result: dict[str, Any]) -> None:
    rows = [(k, v) for k, v in result.items() if not isinstance(v, dict)]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v:.2f}" if isinstance(v, float) else f"{k:<{width}}  {v}")
    for k, v in result.items():
        if isinstance(v, dict) and k != "engine_args":
            print(f"-- {k}: " + ", ".join(f"{a}={b:.3f}" if isinstance(b, float) else f"{a}={b}"
                                         for a, b in v.items()))
    sys.stdout.flush()
