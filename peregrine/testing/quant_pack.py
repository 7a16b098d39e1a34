"""Write weight-only int checkpoints in the published formats (AutoAWQ GEMM, AutoGPTQ / GPTQModel
v1 and v2, compressed-tensors pack-quantized), with the dequantized twin as a plain checkpoint.

The packers follow each format's own description, written out here independently of the
readers in layers/quantization/ (they share no packing code), so a test that reads these
checkpoints checks the readers against the formats, not against themselves.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_FUSED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up",
          "up_proj": "gate_up"}
FORMATS = ("awq", "gptq", "gptq_v2", "compressed-tensors")
# AutoAWQ's GEMM packing: slot i of a word holds output column AWQ_PACK_ORDER[i] of its eight.
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def quantize_grouped(w: torch.Tensor, bits: int, g_idx: torch.Tensor, num_groups: int,
                     sym: bool, min_zero: int = 0
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest of w (out, in), input i in group g_idx[i]: unsigned q (out, in), scales
    and unsigned zero points (out, groups). Symmetric: zero 2^(b-1), scale amax / (2^(b-1) - 1);
    asymmetric: min/max over the group, zeros clamped to [min_zero, 2^b - 1]."""
    out = w.shape[0]
    w = w.float()
    idx = g_idx.long().expand(out, -1)  # (out, in)
    lo = torch.zeros(out, num_groups).scatter_reduce(1, idx, w, "amin", include_self=False)
    hi = torch.zeros(out, num_groups).scatter_reduce(1, idx, w, "amax", include_self=False)
    top = (1 << bits) - 1
    if sym:
        scales = torch.maximum(lo.abs(), hi.abs()).clamp(min=1e-8) / ((1 << (bits - 1)) - 1)
        zeros = torch.full((out, num_groups), 1 << (bits - 1), dtype=torch.int64)
    else:
        lo, hi = lo.clamp(max=0), hi.clamp(min=0)
        scales = ((hi - lo) / top).clamp(min=1e-8)
        zeros = torch.round(-lo / scales).long().clamp(min_zero, top)
    q = (torch.round(w / scales.gather(1, idx)) + zeros.gather(1, idx)).clamp(0, top).long()
    return q, scales, zeros


def _words(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Rows of 32 // bits unsigned values (..., per) -> int32 words, value j in bits j*bits."""
    word = torch.zeros(values.shape[:-1], dtype=torch.int64)
    for j in range(values.shape[-1]):
        word |= values[..., j].long() << (j * bits)
    return torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)


def pack_along_last(values: torch.Tensor, bits: int) -> torch.Tensor:
    per = 32 // bits
    return _words(values.reshape(*values.shape[:-1], -1, per), bits)


def pack_awq(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> dict[str, torch.Tensor]:
    """AutoAWQ GEMM: qweight (in, out / 8), qzeros (in / G, out / 8), scales (in / G, out) fp16."""
    def pack(t: torch.Tensor) -> torch.Tensor:  # t (rows, out): interleave each 8 columns
        cols = t.reshape(t.shape[0], -1, 8)  # (rows, out / 8, 8)
        return _words(cols[..., list(AWQ_PACK_ORDER)], 4)
    return {"qweight": pack(q.t()), "qzeros": pack(zeros.t()),
            "scales": scales.t().contiguous().to(torch.float16)}


def pack_gptq(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor,
              bits: int, v1: bool) -> dict[str, torch.Tensor]:
    """AutoGPTQ: qweight (in / p, out) along the input dim, qzeros (G, out / p) along the output
    dim (v1 stores zero - 1), scales (G, out) fp16, g_idx (in,) int32."""
    per = 32 // bits
    qt = q.t()  # (in, out)
    qweight = _words(qt.reshape(-1, per, qt.shape[1]).transpose(1, 2), bits)  # (in / p, out)
    z = zeros.t() - (1 if v1 else 0)  # (G, out)
    return {"qweight": qweight, "qzeros": pack_along_last(z, bits),
            "scales": scales.t().contiguous().to(torch.float16),
            "g_idx": g_idx.to(torch.int32)}


def pack_compressed(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
                    dtype: torch.dtype, g_idx: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """compressed-tensors pack-quantized: weight_packed (out, in / p), weight_scale (out, G),
    weight_zero_point (out / p, G) packed along the output dim, weight_shape, weight_g_idx."""
    tensors = {"weight_packed": pack_along_last(q, bits), "weight_scale": scales.to(dtype),
               "weight_shape": torch.tensor(list(q.shape), dtype=torch.int64)}
    if zeros is not None:
        tensors["weight_zero_point"] = pack_along_last(zeros.t(), bits).t().contiguous()
    if g_idx is not None:
        tensors["weight_g_idx"] = g_idx.to(torch.int32)
    return tensors


def _config(fmt: str, bits: int, group: int, sym: bool, act_order: bool) -> dict[str, Any]:
    if fmt == "awq":
        return {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": None}
    if fmt in ("gptq", "gptq_v2"):
        return {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order,
                "sym": sym, "checkpoint_format": fmt, "true_sequential": True}
    weights = {"num_bits": bits, "type": "int", "symmetric": sym,
               "strategy": "channel" if group == -1 else "group",
               "group_size": None if group == -1 else group,
               "actorder": "group" if act_order else None, "dynamic": False}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": None, "format": "pack-quantized"}}}


def write_quantized_checkpoint(src: Path, dst: Path, fmt: str, *, bits: int = 4,
                               group_size: int = 128, sym: bool = False, act_order: bool = False,
                               seed: int = 0) -> tuple[Path, Path]:
    """Quantize every projection of checkpoint `src` and write it to `dst` in format `fmt`; the
    dequantized weights go to `dst`-reference as a plain checkpoint. Returns both paths."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r} (known: {', '.join(FORMATS)})")
    if fmt == "awq" and (bits != 4 or sym or act_order):
        raise ValueError("AutoAWQ GEMM checkpoints are 4-bit with zero points, no act-order")
    ref = dst.parent / f"{dst.name}-reference"
    shutil.copytree(src, dst)
    shutil.copytree(src, ref)
    gen = torch.Generator().manual_seed(seed)
    packed, plain = {}, {}
    orders: dict[str, torch.Tensor] = {}
    for name, t in load_file(src / "model.safetensors").items():
        parts = name.rsplit(".", 2)
        if not (name.endswith(".weight") and len(parts) == 3 and parts[1] in PROJECTIONS):
            packed[name] = plain[name] = t
            continue
        out, k = t.shape
        group = k if group_size == -1 else group_size
        groups = k // group
        g_idx = torch.arange(k) // group
        if act_order:
            # NOTE: GPTQ's act-order visits inputs by the Hessian's diagonal, which depends only
            # on the input: projections of one input (q/k/v, gate/up) share the order.
            key = name.replace(parts[1], _FUSED.get(parts[1], parts[1]))
            if key not in orders:
                orders[key] = torch.argsort(torch.randperm(k, generator=gen))
            g_idx = g_idx[orders[key]]
        q, scales, zeros = quantize_grouped(t, bits, g_idx, groups, sym,
                                            min_zero=1 if fmt == "gptq" else 0)
        prefix = name[:-len("weight")]
        if fmt == "awq":
            tensors = pack_awq(q, scales, zeros)
            scales = tensors["scales"].t().float()
        elif fmt in ("gptq", "gptq_v2"):
            tensors = pack_gptq(q, scales, zeros, g_idx, bits, v1=fmt == "gptq")
            scales = tensors["scales"].t().float()
        else:
            tensors = pack_compressed(q, scales, None if sym else zeros, bits, t.dtype,
                                      g_idx if act_order else None)
            scales = tensors["weight_scale"].float()
        packed.update({prefix + k_: v for k_, v in tensors.items()})
        idx = g_idx.long().expand(out, -1)
        w = (q.float() - zeros.float().gather(1, idx)) * scales.gather(1, idx)  # (out, in)
        plain[name] = w.to(t.dtype).contiguous()
    save_file(packed, dst / "model.safetensors")
    save_file(plain, ref / "model.safetensors")
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = _config(fmt, bits, group_size, sym, act_order)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst, ref
