"""`peregrine bench throughput` (W1) and `peregrine bench latency` (W2), optionally beside transformers."""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

from peregrine.config import EngineArgs
from peregrine.entrypoints.model_path import model_folder
from peregrine.sampling_params import SamplingParams


def w1_requests(num: int, seed: int, min_in: int, max_in: int, min_out: int,
                max_out: int) -> tuple[list[list[int]], list[int]]:
    """W1: all prompts first, then all output lengths, from Python's random after seed()."""
    random.seed(seed)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(min_in, max_in))]
               for _ in range(num)]
    out_lens = [random.randint(min_out, max_out) for _ in range(num)]
    return prompts, out_lens


def run_throughput(ns: argparse.Namespace) -> dict[str, Any]:
    from peregrine.entrypoints.llm import LLM
    prompts, out_lens = w1_requests(ns.num_prompts, ns.seed, ns.min_input, ns.max_input,
                                    ns.min_output, ns.max_output)
    args = _engine_args(ns, max_model_len=ns.max_input + ns.max_output)
    llm = LLM(**args)
    params = [SamplingParams(temperature=ns.temperature, max_tokens=n, ignore_eos=True, seed=i)
              for i, n in enumerate(out_lens)]
    # Warm-up: a few short requests so compilation and autotuning stay out of the timing.
    llm.generate(prompts[:4], [SamplingParams(max_tokens=8, ignore_eos=True)] * 4, use_tqdm=False)
    _sync()
    t0 = time.perf_counter()
    timings = host_timings(llm.engine)
    for t in timings.values():
        t.clear()
    if ns.torch_profile:
        _profile_steps(llm.engine, ns.torch_profile, ns.torch_profile_out)
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
              "engine_args": {k: v for k, v in args.items() if k != "model"},
              "host_profile_s": profile}
    del llm
    if ns.compare_transformers:
        result["transformers"] = _hf_continuous_batching(ns, prompts, out_lens)
    return result


def host_timings(engine) -> dict[str, dict[str, float]]:
    """Cumulative host seconds per phase of an in-process engine: front end, core, runner."""
    core = engine.core_client.core
    return {"engine": engine.timing, "core": core.timing,
            "runner": core.executor.worker.model_runner.timing}


def _profile_steps(engine, window: str, out_path: str | None) -> None:
    """Wrap engine.step so that steps [a, b) run under torch.profiler; print the top kernels."""
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
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.generation import GenerationConfig
    n = min(ns.hf_requests, len(prompts))
    cfg = AutoConfig.from_pretrained(model_folder(ns.model))
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
    from peregrine.engine.llm_engine import LLMEngine
    args = _engine_args(ns, max_model_len=ns.input_len + ns.output_len + 16)
    engine = LLMEngine.from_engine_args(EngineArgs(**args))
    random.seed(ns.seed)
    prompt = [random.randint(0, 10000) for _ in range(ns.input_len)]
    params = SamplingParams(temperature=0.0, max_tokens=ns.output_len, ignore_eos=True)
    runs = []
    for it in range(ns.warmup + ns.iters):
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
    model = engine.core_client.core.executor.worker.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_per_token = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * torch.empty((), dtype=mc.dtype).element_size()
    avg_ctx = ns.input_len + ns.output_len / 2
    bytes_per_token = weight_bytes + kv_per_token * avg_ctx
    result = {"engine": "peregrine", "workload": "W2", "input_len": ns.input_len,
              "output_len": ns.output_len, "ttft_s": ttft, "decode_s": decode,
              "decode_tokens_per_s": tps, "end_to_end_tokens_per_s": ns.output_len / (ttft + decode),
              "weight_bytes": weight_bytes, "achieved_GBps": bytes_per_token * tps / 1e9,
              "hbm_ceiling_GBps": 4200.0}
    del engine
    if ns.compare_transformers:
        result["transformers"] = _hf_generate_latency(ns, prompt)
    return result


def _hf_generate_latency(ns, prompt) -> dict[str, Any]:
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.from_pretrained(model_folder(ns.model))
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


def _engine_args(ns: argparse.Namespace, max_model_len: int) -> dict[str, Any]:
    args = dict(model=model_folder(ns.model), load_format=ns.load_format, dtype=ns.dtype,
                skip_tokenizer_init=True, max_model_len=max_model_len, seed=ns.seed,
                enforce_eager=ns.enforce_eager, enable_prefix_caching=not ns.no_prefix_caching)
    for key in ("max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization",
                "attention_backend", "num_gpu_blocks_override"):
        if getattr(ns, key, None) is not None:
            args[key] = getattr(ns, key)
    return args


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def build_parser(kind: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"peregrine bench {kind}")
    p.add_argument("--model", required=True, help="model folder, or a config .json (dummy weights)")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--num-gpu-blocks-override", type=int, default=None)
    p.add_argument("--compare-transformers", action="store_true")
    p.add_argument("--output-json", default=None)
    if kind == "throughput":
        p.add_argument("--num-prompts", type=int, default=256)
        p.add_argument("--min-input", type=int, default=100)
        p.add_argument("--max-input", type=int, default=1024)
        p.add_argument("--min-output", type=int, default=100)
        p.add_argument("--max-output", type=int, default=1024)
        p.add_argument("--temperature", type=float, default=0.6)
        p.add_argument("--hf-requests", type=int, default=32)
        p.add_argument("--torch-profile", default=None, help="profile engine steps A:B")
        p.add_argument("--torch-profile-out", default=None)
    else:
        p.add_argument("--input-len", type=int, default=128)
        p.add_argument("--output-len", type=int, default=256)
        p.add_argument("--warmup", type=int, default=1)
        p.add_argument("--iters", type=int, default=3)
    return p


def main(kind: str, argv: list[str]) -> int:
    ns = build_parser(kind).parse_args(argv)
    result = run_throughput(ns) if kind == "throughput" else run_latency(ns)
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
