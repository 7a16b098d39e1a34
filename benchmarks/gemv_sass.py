"""SASS instructions per weight value in the K loop of the weight-only int GEMV's variants
(kernels/wna16_gemv.py, kernels/wna16_gemv_mma.py), compiled offline for an sm_90 GPU: no GPU needed, only the ptxas and
nvdisasm that the Triton wheel bundles.

    python benchmarks/gemv_sass.py --out /tmp/out/gemv_sass.json

Per variant, bits, zero points, activation dtype and row count: registers, the K loop's
instruction count, per weight value (the loop's instructions / the values one thread
dequantizes per iteration) and the count of each opcode. A compute-bound decode GEMV needs
about 3 or fewer per 4-bit value to keep up with an H200's HBM (a warp issues one instruction
per cycle per scheduler: 4 x 32 lanes x 132 SMs x ~1.9 GHz against ~9.6e12 values/s at 4.8 TB/s).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from peregrine.kernels import wna16_gemv as g  # noqa: E402
from peregrine.kernels.wna16_gemv_inplace import _wna16_gemv_inplace_kernel  # noqa: E402
from peregrine.kernels.wna16_gemv_mma import _wna16_gemv_mma_kernel  # noqa: E402

_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
_ACT = {"bf16": tl.bfloat16, "fp16": tl.float16}


def _compile(fn, sig: dict[str, str], constexprs: dict, warps: int):
    names = list(sig)
    for k in constexprs:
        sig[k] = "constexpr"
    # NOTE: pointers and N, K are 16-aligned at real shapes: Triton specialises on it there.
    aligned = [n for n in names if n.endswith("_ptr")] + ["N", "K"]
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))


def _k_loop(cubin: bytes) -> tuple[list[str], int]:
    """The instructions of the longest backward-branch loop (the K loop), and the registers."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        Path(path).write_bytes(cubin)
        text = subprocess.run([str(_BIN / "nvdisasm"), "-c", path], capture_output=True,
                              text=True, check=True).stdout
        res = subprocess.run([str(_BIN / "cuobjdump"), "-res-usage", path], capture_output=True,
                             text=True, check=True).stdout
    regs = int(re.search(r"REG:(\d+)", res).group(1))
    labels: dict[str, int] = {}
    instrs: list[str] = []
    for ln in text.splitlines():
        m = re.match(r"^\s*\.(L_x_\d+):", ln)
        if m:
            labels[m.group(1)] = len(instrs)
            continue
        m = re.match(r"^\s*/\*[0-9a-f]{4,}\*/\s+(.*?);", ln)
        if m:
            instrs.append(m.group(1).strip())
    loops = []
    for i, ins in enumerate(instrs):
        m = re.search(r"BRA\s.*?\.(L_x_\d+)", ins)
        if m and labels.get(m.group(1), i + 1) <= i:
            loops.append(instrs[labels[m.group(1)]:i + 1])
    return max(loops, key=len), regs


def count(variant: str, bits: int, zp: bool, act: str, rows: int,
          tile: tuple[int, int, int] | None = None) -> dict:
    """One compile's K-loop statistics, with the launch config the GEMV would use or `tile`
    (block_n, block_k, warps)."""
    ptr = f"*{act}"
    common = {"a_ptr": ptr, "q_ptr": "*i32"}
    if variant == "mma":
        sig = dict(common, s_ptr=ptr, z_ptr=ptr, part_ptr="*fp32", lock_ptr="*i32", c_ptr=ptr,
                   M="i32", N="i32", K="i32", stride_cm="i32", K_ITERS="i32", SPLIT_K="i32")
        bn, bk, warps = g._MMA_BLOCK_N, g._MMA_BLOCK_K, 4
        ce = dict(BITS=bits, HAS_ZP=zp, GROUP=128, ASM=True, DOT=_ACT[act], BLOCK_N=bn,
                  BLOCK_K=bk, HAS_SPLIT=True, EVEN_N=True, EVEN_K=True)
        kernel = _wna16_gemv_mma_kernel
    elif variant in ("inplace", "inplace_prefetch"):
        sig = dict(a_ptr=ptr, a64_ptr="*i64" if act == "bf16" else ptr, q_ptr="*i32",
                   s_ptr=ptr, z_ptr=ptr, part_ptr="*fp32", lock_ptr="*i32", c_ptr=ptr,
                   M="i32", N="i32", K="i32", stride_am="i32", stride_cm="i32", K_ITERS="i32",
                   SPLIT_K="i32")
        bn, bk, warps = g._BLOCK_N, g._block_k(bits), 8 if rows > 4 else 4
        if tile:
            bn, bk, warps = tile
        ce = dict(GROUP=128, BITS=bits, HAS_ZP=zp, ASM=True, X_BF16=act == "bf16",
                  EVEN_K=True, PREFETCH=variant == "inplace_prefetch", BLOCK_M=rows,
                  BLOCK_N=bn, BLOCK_K=bk, HAS_SPLIT=True)
        kernel = _wna16_gemv_inplace_kernel
    else:
        sig = dict(common, qhi_ptr="*i32", s_ptr=ptr, z_ptr=ptr, part_ptr="*fp32",
                   lock_ptr="*i32", c_ptr=ptr, M="i32", N="i32", K="i32", stride_am="i32",
                   stride_cm="i32", K_ITERS="i32", SPLIT_K="i32")
        bn, bk, warps = g._BLOCK_N, g._block_k(bits), 8 if rows > 4 else 4
        ce = dict(GROUP=128, BITS=bits, HAS_ZP=zp, PER_WORD=False, BLOCK_M=rows, BLOCK_N=bn,
                  BLOCK_K=bk, HAS_SPLIT=True, PREFETCH=variant == "fma_prefetch")
        kernel = g._wna16_gemv_fma_kernel
    compiled = _compile(kernel, sig, ce, warps)
    loop, regs = _k_loop(compiled.asm["cubin"])
    values = bn * bk / (32 * warps)  # weight values per thread per K iteration
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0].split(".")[0]
                              for ins in loop)
    return dict(variant=variant, bits=bits, zero_points=zp, act=act, rows=rows, warps=warps,
                block_n=bn, block_k=bk, registers=regs, loop_instructions=len(loop),
                per_value=len(loop) / values, opcodes=dict(ops.most_common()))


CASES = [("fma", 4, True, "bf16", 1), ("fma", 4, True, "bf16", 2), ("fma", 4, True, "bf16", 4),
         ("fma", 8, False, "bf16", 1), ("fma_prefetch", 4, True, "bf16", 1),
         ("fma_prefetch", 4, True, "bf16", 4), ("fma_prefetch", 4, True, "bf16", 8),
         ("fma_prefetch", 6, True, "bf16", 8), ("fma_prefetch", 8, False, "bf16", 1),
         ("mma", 4, True, "bf16", 1), ("mma", 4, False, "bf16", 1),
         ("mma", 4, True, "fp16", 1), ("mma", 8, False, "bf16", 1), ("mma", 8, False, "fp16", 1),
         ("inplace", 4, True, "bf16", 1), ("inplace", 4, True, "bf16", 2),
         ("inplace", 4, True, "bf16", 4), ("inplace", 4, False, "fp16", 1),
         ("inplace", 8, False, "bf16", 1), ("inplace_prefetch", 4, True, "bf16", 1),
         ("inplace_prefetch", 4, True, "bf16", 4)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON results path")
    ns = p.parse_args()
    rows = []
    print(f"triton {triton.__version__}, sm_90 (mma: any row count up to 16 compiles the same)")
    print(f"{'variant':12} {'bits':>4} {'zp':>3} {'act':4} {'rows':>4} {'regs':>4} "
          f"{'loop':>5} {'/value':>6}  top opcodes")
    for case in CASES:
        r = count(*case)
        rows.append(r)
        top = " ".join(f"{o}:{c}" for o, c in list(r["opcodes"].items())[:6])
        print(f"{r['variant']:12} {r['bits']:4d} {int(r['zero_points']):3d} {r['act']:4} "
              f"{r['rows']:4d} {r['registers']:4d} {r['loop_instructions']:5d} "
              f"{r['per_value']:6.2f}  {top}")
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(dict(triton=triton.__version__, target="sm_90",
                                            rows=rows), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
