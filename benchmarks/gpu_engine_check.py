"""GPU equality checks for the engine (issue 3, point 7); run on the device machine.

1. float32: triton backend + CUDA graphs gives greedy tokens identical to the torch backend (eager).
2. bfloat16: teacher-forced top-1 agreement between the two backends >= 95% over 64 new tokens, and
   every mismatch is a near-tie (top-2 logprob gap < 1e-2 relative).
Also runs each configuration with prefix caching / chunked prefill / preemption on and off.
Writes $OUT/engine_check.json when OUT is set; exits 1 if a check fails.
"""
from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
import time

import torch

from peregrine import LLM, SamplingParams
from peregrine.testing.checkpoints import build_tiny_checkpoint

NEW = 64


def _checkpoint(dtype: torch.dtype, arch: str = "qwen3", **overrides) -> str:
    # Big enough for real kernel shapes (head_dim 128, GQA 4:1), small enough to build in seconds.
    d = tempfile.mkdtemp(prefix="peregrine-gpu-check-")
    return str(build_tiny_checkpoint(d, arch, dtype=dtype, hidden_size=512, head_dim=128,
                                     num_attention_heads=8, num_key_value_heads=2,
                                     intermediate_size=1024, num_hidden_layers=4,
                                     max_position_embeddings=1024, **overrides))


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(5, 500, (n,), generator=g).tolist() for n in (7, 33, 100, 250, 16, 64)]


def _generate(path: str, dtype: str, backend: str, eager: bool, **kw) -> list:
    llm = LLM(path, dtype=dtype, attention_backend=backend, enforce_eager=eager, max_model_len=512,
              gpu_memory_utilization=0.3, **kw)
    sp = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=2)
    outs = llm.generate(_prompts(), sp, use_tqdm=False)
    _release(llm)
    return outs


def _teacher_forced(path: str, dtype: str, backend: str, seqs: list[list[int]]) -> list:
    llm = LLM(path, dtype=dtype, attention_backend=backend, enforce_eager=True, max_model_len=512,
              gpu_memory_utilization=0.3, enable_prefix_caching=False)
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=2)
    outs = llm.generate(seqs, sp, use_tqdm=False)
    _release(llm)
    return outs


def _release(llm: LLM) -> None:
    """Free an engine's GPU memory before the next one profiles what is left."""
    llm.engine.runner.graphs = None
    llm.engine.runner.kv_caches = None
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def _triton_matches_torch(path: str, variants: dict[str, dict], label: str,
                          report: dict) -> bool:
    """float32 greedy tokens of the Triton backend in each variant against the torch backend's
    (eager); a variant's "_eager" key runs Triton without CUDA graphs."""
    ref = [o.outputs[0].token_ids for o in _generate(path, "float32", "torch", True)]
    ok = True
    for name, kw in variants.items():
        kw = dict(kw)
        eager = kw.pop("_eager", False)
        got = [o.outputs[0].token_ids for o in _generate(path, "float32", "triton", eager, **kw)]
        same = got == ref
        report[f"{label}_{name}_identical"] = same
        ok &= same
        print(f"{label} triton {name:>24}: identical to torch = {same}", flush=True)
    return ok


def check_fp32(report: dict) -> bool:
    variants = {
        "graphs": {},
        "graphs+chunked": {"max_num_batched_tokens": 64},
        "graphs+preempt": {"num_gpu_blocks_override": 40},
        "graphs+no_prefix_cache": {"enable_prefix_caching": False},
        "eager": {"_eager": True},
        "graphs+sync_scheduling": {"async_scheduling": False},
    }
    if "--quick" in sys.argv:
        variants = {k: variants[k] for k in ("graphs", "graphs+preempt")}
    return _triton_matches_torch(_checkpoint(torch.float32), variants, "fp32", report)


def check_sliding_window(report: dict) -> bool:
    """Mistral-style sliding window (64 tokens, prompts up to 250): Triton with graphs, plain
    and chunked, gives the torch backend's greedy tokens in float32."""
    path = _checkpoint(torch.float32, "mistral", sliding_window=64)
    variants = {"graphs": {}, "graphs+chunked": {"max_num_batched_tokens": 64}}
    return _triton_matches_torch(path, variants, "window_fp32", report)


def _fp32_relative_gaps(path: str, seqs: list[list[int]],
                        mismatches: list[tuple[int, int, int, int]]) -> list[float]:
    if not mismatches:
        return []
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    gaps = []
    with torch.no_grad():
        for si in sorted({m[0] for m in mismatches}):
            logits = model(torch.tensor([seqs[si]], device="cuda")).logits[0].float()  # (L, V)
            for s2, pos, ta, tb in mismatches:
                if s2 == si:
                    row = logits[pos - 1]  # logits at pos-1 predict token pos
                    top = max(row[ta].item(), row[tb].item())
                    gaps.append(abs(row[ta].item() - row[tb].item()) / max(abs(top), 1e-6))
    del model
    torch.cuda.empty_cache()
    return gaps


def check_bf16(report: dict) -> bool:
    path = _checkpoint(torch.bfloat16)
    torch_outs = _generate(path, "bfloat16", "torch", True)
    triton_outs = _generate(path, "bfloat16", "triton", False)
    # Decode path: how far the two greedy runs agree before the first divergence.
    prefix_agree = []
    for a, b in zip(torch_outs, triton_outs):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        n = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta))
        prefix_agree.append(n)
    # Prefill path, teacher-forced on the torch continuation: per-position top-1 agreement.
    seqs = [p + o.outputs[0].token_ids for p, o in zip(_prompts(), torch_outs)]
    tf_torch = _teacher_forced(path, "bfloat16", "torch", seqs)
    tf_triton = _teacher_forced(path, "bfloat16", "triton", seqs)
    total = agree = 0
    mismatches: list[tuple[int, int, int, int]] = []  # (sequence, position, torch top-1, triton top-1)
    for si, (p, a, b) in enumerate(zip(_prompts(), tf_torch, tf_triton)):
        for pos in range(len(p), len(a.prompt_token_ids)):
            top_a = min(a.prompt_logprobs[pos].items(), key=lambda kv: kv[1].rank or 99)[0]
            top_b = min(b.prompt_logprobs[pos].items(), key=lambda kv: kv[1].rank or 99)[0]
            total += 1
            agree += top_a == top_b
            if top_a != top_b:
                mismatches.append((si, pos, top_a, top_b))
    # NOTE: near-tie = the two candidates' logits differ by < 1e-2 of the top logit's magnitude,
    # judged on float32 logits of the same weights (transformers), which neither backend computed.
    gaps = _fp32_relative_gaps(path, seqs, mismatches)
    near_tie_violations = sum(g >= 1e-2 for g in gaps)
    rate = agree / max(total, 1)
    report.update(bf16_teacher_forced_positions=total, bf16_top1_agreement=rate,
                  bf16_mismatches_not_near_tie=near_tie_violations, bf16_mismatch_rel_gaps=gaps,
                  bf16_decode_prefix_agreement=prefix_agree)
    print(f"bf16 top-1 agreement {rate:.4f} over {total} positions; non-near-tie mismatches "
          f"{near_tie_violations}; greedy prefix agreement {prefix_agree}", flush=True)
    return rate >= 0.95 and near_tie_violations == 0


def main() -> int:
    report: dict = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    t0 = time.time()
    ok = check_fp32(report)
    ok &= check_sliding_window(report)
    if "--fp32-only" not in sys.argv:
        ok &= check_bf16(report)
    report["elapsed_s"] = time.time() - t0
    report["ok"] = bool(ok)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "engine_check.json"), "w") as f:
            json.dump(report, f, indent=2)
    print("ENGINE CHECK", "PASSED" if ok else "FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
