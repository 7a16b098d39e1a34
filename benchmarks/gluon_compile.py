"""The Gluon kernels compiled offline for an sm_90a GPU: no GPU needed, only Triton and the
ptxas, cuobjdump and nvdisasm its wheel bundles (peregrine/testing/offline_compile.py).

    python benchmarks/gluon_compile.py --out /tmp/out/gluon_compile.json
    python benchmarks/gluon_compile.py --jobs layers:engine,layers:fold --shapes llama3-8b \\
        --regs 128,168

Jobs: `gemv_tc4` / `gemv_tc6` (the 4- and 6-bit tensor-core GEMV, one row), `w8_tc` (the FP8
tensor-core GEMV), `attn_fp8` (the FP8-cache decode attention's split kernel), `rows` /
`rows_pre` (the row-tile probe's kernel), `decode_rows` / `decode_rows_pre` (the row-tile
persistent decode kernel, kernels/decode_rows.py, its inputs' buffers as large as
Llama-3-8B's) and `layers:<form>` (the persistent decode kernel, kernels/decode_layers.py, in
a form of FORMS, at each register cap of --regs). Per job: registers, stack bytes (the spills'
room), spill stores and loads, shared memory, a few SASS instructions' counts and the PTX pieces
the design depends on, and the values a loop carries only as an inner loop's bound (which
Triton 3.6 miscompiles, `offline_compile.carried_bounds`); or the compiler's error. Shapes:
`small` (a 512-wide model, fast) or `llama3-8b` (the persistent kernel packed for 132 programs
from Llama-3-8B's shapes). Triton must not be in interpreter mode (TRITON_INTERPRET unset): its
reductions would be the interpreter's.
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
from unittest import mock

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.decode_layer_ring import LLAMA3_8B, build, call  # noqa: E402
from peregrine.testing.offline_compile import (carried_bounds, offline_compile,  # noqa: E402
                                               resources)

_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
# the persistent kernel's forms: DecodeLayers attributes (the engine's: the defaults)
FORMS = {
    "engine": {},
    "now": {"defer": False},
    "fold": {"fold": 1},
    "acc2": {"acc2": True},
    "pair": {"pair": True},
    "f16": {"f16": True},
    "f16pair": {"f16": True, "pair": True},
    "pipe": {"pipe": True},
    "pipexsum": {"pipe": True, "xsum": True},
    "l2": {"x_smem": False},
    "allpoll": {"poll_one": False},
    "xpairs": {"x_pairs": True},
    "traced": {"trace": True},
    "free": {"wait": False},
}
SHAPES = {"small": dict(LLAMA3_8B, H=512, HEADS=8, KVH=2, INTER=1024), "llama3-8b": LLAMA3_8B,
          # (the row-tile kernel's chunks are 1,024 inputs)
          "rows": dict(LLAMA3_8B, H=1024, HEADS=8, KVH=2, INTER=2048)}
# SASS opcode prefixes counted
OPS = ("UTMALDG", "HMMA", "IMMA", "ATOM", "RED", "LDG", "LDS", "STG", "MEMBAR", "FENCE", "BAR",
       "SYNCS", "LDL", "STL")
# PTX pieces counted
PTX = {"tma": "cp.async.bulk.tensor", "cp_async": "cp.async.cg", "mma": "mma.sync.aligned",
       "release_inc": "atom.release.gpu.global.inc", "acquire_loads": "ld.acquire.gpu",
       "fence_acq_rel": "fence.acq_rel.gpu", "ld_shared_v4": "ld.shared.v4",
       "prmt": "prmt.b32", "wgmma": "wgmma.mma_async", "shr": "shr.u32",
       "mul_hi": "mul.hi.u32", "sub_bf16x2": "sub.rn.bf16x2", "sub_f16x2": "sub.rn.f16x2",
       "fma_f16x2": "fma.rn.f16x2", "imma": "m16n8k32.row.col.s32.u8.s8"}

# an MMA whose A operand is one register four times (a constant weight: the input sums' MMAs)
_CONST_A = re.compile(r"mma\.sync\.aligned\S*\s*\{[^}]*\},\s*\{(%r\d+), \1, \1, \1\}")


def report(kernel) -> dict:
    """Registers, spills, shared memory and instruction counts of a compiled kernel."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        Path(path).write_bytes(kernel.asm["cubin"])
        sass = subprocess.run([str(_BIN / "nvdisasm"), "-c", path], capture_output=True,
                              text=True, check=True).stdout
    ops = collections.Counter()
    for ln in sass.splitlines():
        m = re.match(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", ln)
        if m:
            for name in OPS:
                if m.group(1).startswith(name):
                    ops[name] += 1
    ptx = kernel.asm["ptx"]
    return {"kernel": kernel.name, **resources(kernel), "spill_stores": ops["STL"],
            "spill_loads": ops["LDL"], "ops": dict(sorted(ops.items())),
            "ptx": {**{name: ptx.count(piece) for name, piece in PTX.items()},
                    "mma_const_a": len(_CONST_A.findall(ptx))},
            "arrives": arrives(ptx),
            "carried_bounds": carried_bounds(kernel.asm.get("source")
                                             or kernel.asm.get("ttir", ""))}


def arrives(ptx: str) -> dict:
    """The plain mbarrier arrives (a consumer giving a ring slot back; not the producer's
    arrive with an expected byte count), how many of them a bar.sync comes right before
    (among the last few instructions): one thread arrives for all the warps, so it must; and
    how many a proxy fence comes before too, among the last few dozen (a ring slot's reads,
    ordered before the TMA that refills it)."""
    lines = [ln.strip() for ln in ptx.splitlines()
             if ln.strip() and not ln.strip().startswith(("//", ".loc", "$"))]
    total = fenced = proxy = 0
    for i, ln in enumerate(lines):
        if "mbarrier.arrive.shared::cta.b64" in ln and "expect_tx" not in ln:
            total += 1
            fenced += any(p.startswith("bar.sync") for p in lines[max(0, i - 4):i])
            proxy += any(p.startswith("fence.proxy.async") for p in lines[max(0, i - 24):i])
    return {"plain": total, "after_a_barrier": fenced, "after_a_proxy_fence": proxy}


def _gemv_tc(bits: int) -> None:
    from peregrine.kernels.gemv import GemvConfig
    from peregrine.kernels.wna16_gemv import _tc_launch
    from peregrine.layers.quantization.wna16 import WNA16Layout
    k, n = 1024, 512
    q = torch.randint(0, 1 << bits, (k, n), dtype=torch.int32)
    zp = torch.randint(0, 1 << bits, (k // 128, n)).float()
    w = WNA16Layout.build(q, torch.rand(k // 128, n), zp, None, bits, torch.bfloat16)
    _tc_launch(torch.zeros(1, k, dtype=torch.bfloat16), w, GemvConfig(128, 128, 2, 4, 4), False)


def _w8_tc() -> None:
    from peregrine.kernels import w8_gemv_tc as w8
    n, k = 256, 1024
    # (its check asks a CUDA device for sm_89+: answered for sm_90)
    with mock.patch.object(w8, "fp8_tc_weight_ok", lambda *a, **kw: True):
        w8.w8_gemv_tc(torch.zeros(1, k, dtype=torch.bfloat16),
                      torch.randn(n, k).to(torch.float8_e4m3fn), torch.rand(n))


def _attn_fp8() -> None:
    from peregrine.kernels import decode_attention_mma as dam
    from peregrine.kernels.decode_attention import paged_decode_attention
    cache = torch.zeros(8, 16, 2, 128).to(torch.float8_e4m3fn)
    with mock.patch.object(dam, "has_fp8_convert", lambda device: True):
        paged_decode_attention(torch.zeros(2, 8, 128, dtype=torch.bfloat16), cache,
                               cache.clone(), torch.zeros(2, 4, dtype=torch.int32),
                               torch.tensor([20, 30], dtype=torch.int32), 0.1,
                               variant="mma_fp8")


def _rows_probe(pre: bool) -> None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from benchmarks import ring_rows_probe as rp
    rows = torch.zeros(17 * 64, rp.ROW, dtype=torch.int32)
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    desc = [TensorDescriptor(rows, list(rows.shape), list(rows.stride()), [h, rp.ROW], layout)
            for h in (16, 1)]
    x = torch.zeros(4096, dtype=torch.bfloat16)
    # two programs an SM with a ring of 4 (the form that must fit twice in an SM)
    rp.ring_rows_kernel[(264,)](*desc, torch.zeros(4, 10, dtype=torch.int64), 4, x, x.clone(),
                                torch.zeros(64, dtype=torch.int32), 264, S=4, GMAX=128,
                                CMAX=16, MODE=1, PRE=pre, num_warps=4, maxnreg=128)


def _decode_rows(pre: bool) -> None:
    d = build(1, 8, 37, torch.device("cpu"), SHAPES["rows"], splits=4, rows=True)
    dl = d["dl"]
    dl.stages, dl.pre = 4, pre  # (two programs an SM: the form that must fit twice)
    dl.k_max = LLAMA3_8B["INTER"]  # (its inputs' buffers as large as Llama-3-8B's)
    call(d)


def _int4_steps(form: tuple) -> None:
    from benchmarks import int4_step_bench as sb
    sb.launch(form, (1,), torch.zeros(4 * 512), torch.zeros(sb.WORDS * 512, dtype=torch.int32),
              4)


KERNELS = {"gemv_tc4": (lambda: _gemv_tc(4), "wna16_gemv_tc_kernel"),
           "gemv_tc6": (lambda: _gemv_tc(6), "wna16_gemv_tc_kernel"),
           "w8_tc": (_w8_tc, "w8_gemv_tc_kernel"),
           "attn_fp8": (_attn_fp8, "decode_split_mma_kernel"),
           "rows": (lambda: _rows_probe(False), "ring_rows_kernel"),
           "rows_pre": (lambda: _rows_probe(True), "ring_rows_kernel"),
           "decode_rows": (lambda: _decode_rows(False), "decode_rows_kernel"),
           "decode_rows_pre": (lambda: _decode_rows(True), "decode_rows_kernel"),
           # the int4 steps benchmark's forms (with their sums, if any)
           "steps_bf16": (lambda: _int4_steps(("sync", "bf16", 1)), "steps_sync"),
           "steps_sub": (lambda: _int4_steps(("sync", "bf16", 2)), "steps_sync"),
           "steps_fp16_sub": (lambda: _int4_steps(("sync", "fp16", 2)), "steps_sync"),
           "steps_mulhi": (lambda: _int4_steps(("sync", "bf16-mulhi", 1)), "steps_sync"),
           "steps_fp16": (lambda: _int4_steps(("sync", "fp16", 1)), "steps_sync"),
           "steps_wgmma": (lambda: _int4_steps(("wgmma", "ones", 1)), "steps_wgmma"),
           "steps_wgmma_hsub": (lambda: _int4_steps(("wgmma", "hsub", 2)), "steps_wgmma"),
           "steps_imma": (lambda: _int4_steps(("imma", "u8", 0)), "steps_imma")}


def _compiled(fn, name: str) -> dict:
    with offline_compile() as kernels:
        fn()
    found = [k for k in kernels if k.name == name]
    if len(found) != 1:
        raise RuntimeError(f"expected one {name}, compiled {[k.name for k in kernels]}")
    return report(found[0])


def run(jobs: list[str], shapes: str = "small", regs: tuple[int, ...] = (128,),
        warps: int = 4, stages: int = 16) -> dict:
    """Each job's report, or the compiler's error (the other jobs go on)."""
    out = {}
    layers = None
    for job in jobs:
        caps = regs if job.startswith("layers:") else (None,)
        for r in caps:
            key = job if r is None else f"{job}:r{r}"
            try:
                if job.startswith("layers:"):
                    if layers is None:
                        P, splits = (8, 4) if shapes == "small" else (132, 16)
                        layers = build(1, P, 37, torch.device("cpu"), SHAPES[shapes],
                                       warps=warps, stages=stages, splits=splits)
                        engine = {n: getattr(layers["dl"], n)
                                  for form in FORMS.values() for n in (*form, "regs")}
                    for name, value in {**engine, "regs": r, **FORMS[job[7:]]}.items():
                        setattr(layers["dl"], name, value)
                    out[key] = _compiled(lambda: call(layers), "decode_layers_kernel")
                else:
                    out[key] = _compiled(*KERNELS[job])
            except Exception as e:  # noqa: BLE001 - reported, the other jobs go on
                out[key] = {"error": f"{type(e).__name__}: {str(e)[-3000:]}"}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", default=",".join([*KERNELS, "layers:engine", "layers:fold"]))
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="small")
    ap.add_argument("--regs", default="128", help="the persistent kernel's register caps")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=16)
    ap.add_argument("--out", default=None, help="a JSON file (else printed)")
    a = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("gluon_compile: unset TRITON_INTERPRET (the kernels compile for a GPU)")
    res = {"triton": triton.__version__, "shapes": a.shapes, "warps": a.warps,
           "stages": a.stages,
           "jobs": run(a.jobs.split(","), a.shapes, tuple(int(r) for r in a.regs.split(",")),
                       a.warps, a.stages)}
    text = json.dumps(res, indent=1)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
