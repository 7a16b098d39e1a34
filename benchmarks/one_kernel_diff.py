"""The one-kernel decode path (PEREGRINE_DECODE_LAYERS=1) against the layer-by-layer path inside
the engine, step by step: each one-row decode step runs the kernel, then the layers on the same
inputs (their K/V rows overwrite the kernel's, so no step inherits another's difference), and
the two final hidden states and logits are compared. Also each path's greedy tokens against a
float32 dequantized model (the GPU test's measure). Prints one JSON line per check and writes
the whole record to --out.

    python benchmarks/one_kernel_diff.py --out /tmp/out/one_kernel_diff.json
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch


def build(root: Path, layers: int) -> tuple[str, str]:
    from peregrine.testing.checkpoints import build_tiny_checkpoint
    from peregrine.testing.quant_pack import write_quantized_checkpoint
    src = build_tiny_checkpoint(root / "src", "llama", hidden_size=512, head_dim=128,
                                num_attention_heads=8, num_key_value_heads=2,
                                intermediate_size=1024, num_hidden_layers=layers,
                                max_position_embeddings=1024)
    path, ref = write_quantized_checkpoint(src, root / "awq", "awq", group_size=128)
    return str(path), str(ref)


def _rms(t: torch.Tensor) -> float:
    return float(t.float().pow(2).mean().sqrt())


def step_diffs(path: str, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    """Per one-row decode step: position, hidden and logits differences (over the layer path's
    RMS), whether the two paths' top-1 agree."""
    from peregrine import LLM, SamplingParams
    os.environ["PEREGRINE_DECODE_LAYERS"] = "1"
    llm = LLM(path, dtype="bfloat16", max_model_len=512, seed=0, enforce_eager=True,
              num_gpu_blocks_override=256)
    model = llm.engine.core_client.core.executor.worker.model_runner.model
    assert model.decode_layers is not None, "the one-kernel path is off"
    forward = model.forward
    rows: list[dict] = []

    def both(input_ids, positions, kv_caches, meta, *rest):
        h1 = forward(input_ids, positions, kv_caches, meta, *rest)
        if not (input_ids.shape[0] == 1 and meta.num_decodes == 1):
            return h1
        h1 = h1.clone()
        dl, model.decode_layers = model.decode_layers, None
        try:
            h2 = forward(input_ids, positions, kv_caches, meta, *rest)
        finally:
            model.decode_layers = dl
        l1, l2 = model.compute_logits(h1).float(), model.compute_logits(h2).float()
        rows.append({"pos": int(positions[0]), "slot": int(meta.slot_mapping[0]),
                     "h": _rms(h1.float() - h2.float()) / _rms(h2),
                     "logits": float((l1 - l2).abs().max()) / _rms(l2),
                     "top1_same": bool(l1.argmax() == l2.argmax())})
        return h1

    model.forward = both
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        start = len(rows)
        llm.generate([p], params, use_tqdm=False)
        for r in rows[start:]:
            r["prompt"] = i
    model.forward = forward
    del llm
    torch.cuda.empty_cache()
    return rows


def gaps(path: str, ref: str, prompts: list[list[int]], max_tokens: int, on: bool,
         eager: bool) -> list[dict]:
    """Each picked token's logit gap below the float32 dequantized model's top-1 over the row's
    RMS, with the prompt and position."""
    from transformers import AutoModelForCausalLM

    from peregrine import LLM, SamplingParams
    os.environ["PEREGRINE_DECODE_LAYERS"] = "1" if on else "0"
    llm = LLM(path, dtype="bfloat16", max_model_len=512, seed=0, enforce_eager=eager,
              num_gpu_blocks_override=256)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = [list(llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids)
            for p in prompts]
    del llm
    torch.cuda.empty_cache()
    exact = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).cuda().eval()
    res = []
    with torch.no_grad():
        for i, (p, out) in enumerate(zip(prompts, outs)):
            rows = exact(torch.tensor([p + out], device="cuda")).logits[0, len(p) - 1:-1].float()
            picked = rows.gather(1, torch.tensor(out, device="cuda")[:, None])[:, 0]
            g = ((rows.max(-1).values - picked) / rows.pow(2).mean(-1).sqrt()).tolist()
            res += [{"prompt": i, "pos": len(p) + j, "gap": x} for j, x in enumerate(g)]
    del exact
    torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--out", default="/tmp/out/one_kernel_diff.json")
    a = ap.parse_args()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(5, 500, (n,), generator=g).tolist() for n in (3, 17, 40, 200)]
    record: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        path, ref = build(Path(tmp), a.layers)
        rows = step_diffs(path, prompts, a.max_tokens)
        record["steps"] = rows
        worst = sorted(rows, key=lambda r: -r["logits"])[:8]
        print(json.dumps({"check": "steps", "n": len(rows),
                          "top1_differs": sum(not r["top1_same"] for r in rows),
                          "h_max": max(r["h"] for r in rows),
                          "h_median": sorted(r["h"] for r in rows)[len(rows) // 2],
                          "worst": worst}), flush=True)
        for on, eager in ((True, False), (True, True), (False, False)):
            res = gaps(path, ref, prompts, a.max_tokens, on, eager)
            key = f"gaps_{'kernel' if on else 'layers'}_{'eager' if eager else 'graphs'}"
            record[key] = res
            top = sorted(res, key=lambda r: -r["gap"])[:5]
            print(json.dumps({"check": key, "max": top[0]["gap"],
                              "off_top1": sum(r["gap"] > 0 for r in res), "worst": top}),
                  flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
