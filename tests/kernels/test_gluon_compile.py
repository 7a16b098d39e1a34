"""The Gluon kernels (the 4/6-bit and FP8 tensor-core GEMVs, the FP8-cache attention, the
persistent decode kernel in seven forms, the row-tile probe's kernel, the row-tile persistent
decode kernel in its two forms, the int4 steps benchmark's forms) compile for an sm_90a GPU
with the installed Triton, on the CPU (benchmarks/gluon_compile.py, in a process without
TRITON_INTERPRET): a Triton release that renames what they use fails here rather than at a
GPU's first call. None of them may carry a value from one loop iteration to the next only as
an inner loop's bound, which Triton 3.6 miscompiles. Their numbers are checked on the GPU
(tests/gpu)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.experimental.gluon")
pytestmark = pytest.mark.slow  # (about 15 s of compiling, uncached)

ROOT = Path(__file__).resolve().parents[2]
JOBS = ("gemv_tc4", "gemv_tc6", "w8_tc", "attn_fp8", "layers:engine", "layers:fold",
        "layers:l2", "layers:pipe", "layers:pipexsum", "layers:allpoll", "layers:xpairs",
        "rows", "rows_pre", "decode_rows", "decode_rows_pre", "steps_bf16", "steps_mulhi",
        "steps_fp16", "steps_sub", "steps_fp16_sub", "steps_wgmma", "steps_wgmma_hsub",
        "steps_imma")
SM90_SHARED = 227 * 1024  # the most shared memory a program may take on sm_90


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gluon") / "compile.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gluon_compile.py"),
                           "--jobs", ",".join(JOBS), "--out", str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())["jobs"]


def _job(compiled: dict, name: str) -> dict:
    key = name if not name.startswith("layers:") else f"{name}:r128"
    job = compiled[key]
    assert "error" not in job, job.get("error")
    return job


@pytest.mark.parametrize("name", ("gemv_tc4", "gemv_tc6", "w8_tc"))
def test_the_tensor_core_gemvs_compile(compiled: dict, name: str) -> None:
    job = _job(compiled, name)
    assert job["ptx"]["mma"] > 0 and job["registers"] > 0


def test_the_fp8_cache_attention_compiles(compiled: dict) -> None:
    job = _job(compiled, "attn_fp8")
    # K/V tiles by cp.async into shared memory, read back into tensor-core MMAs
    assert job["ptx"]["cp_async"] > 0 and job["ptx"]["mma"] > 0
    assert job["shared_bytes"] <= SM90_SHARED


@pytest.mark.parametrize("form", ("engine", "fold", "l2", "pipe", "pipexsum", "allpoll",
                                  "xpairs"))
def test_the_persistent_decode_kernel_compiles(compiled: dict, form: str) -> None:
    job = _job(compiled, f"layers:{form}")
    ptx = job["ptx"]
    # the weight ring's TMA copies (words, scales), the phases' waits and tickets, the MMAs
    assert ptx["tma"] >= 2 and ptx["acquire_loads"] > 0 and ptx["release_inc"] > 0
    assert ptx["mma"] > 0
    # x into shared memory once a phase by cp.async, except in the form that reads it via L2
    assert (ptx["cp_async"] > 0) == (form != "l2")
    assert job["shared_bytes"] <= SM90_SHARED
    # a consumed slot is given back by one thread after a proxy fence and a barrier of the
    # consumer warps
    assert job["arrives"]["plain"] > 0
    assert job["arrives"]["after_a_barrier"] == job["arrives"]["plain"], job["arrives"]
    assert job["arrives"]["after_a_proxy_fence"] == job["arrives"]["plain"], job["arrives"]


def test_x_written_as_its_pairs_leaves_the_mma_steps_no_rearranging(compiled: dict) -> None:
    """With x's shared-memory copy rewritten once a phase as its B pairs, the chunk loop's
    four prmt a step are gone: the one rewrite's four are what is left of them."""
    engine = _job(compiled, "layers:engine")["ptx"]["prmt"]
    pairs = _job(compiled, "layers:xpairs")["ptx"]["prmt"]
    assert engine - pairs == 16 - 4, (engine, pairs)


def test_an_arrive_without_a_barrier_before_it_is_counted_apart() -> None:
    sys.path.insert(0, str(ROOT))
    from benchmarks.gluon_compile import arrives
    ptx = "\n".join(["bar.sync 0, 128;", "@%p1 mbarrier.arrive.shared::cta.b64 _, [%r1];",
                     "add.s32 %r2, %r2, 1;", "mov.b32 %r3, 0;", "add.s32 %r4, %r2, 1;",
                     "add.s32 %r5, %r2, 1;", "add.s32 %r6, %r2, 1;",
                     "@%p1 mbarrier.arrive.shared::cta.b64 _, [%r1];",
                     "@%p1 mbarrier.arrive.expect_tx.shared::cta.b64 _, [%r1], 8704;"])
    assert arrives(ptx) == {"plain": 2, "after_a_barrier": 1, "after_a_proxy_fence": 0}
    # a proxy fence after the first arrive comes before the second only
    fenced = ptx.replace("mov.b32 %r3, 0;", "fence.proxy.async.shared::cta;")
    assert arrives(fenced)["after_a_proxy_fence"] == 1


@pytest.mark.parametrize("name", ("rows", "rows_pre"))
def test_the_row_tile_probe_compiles_to_fit_two_programs_an_sm(compiled: dict, name: str) -> None:
    job = _job(compiled, name)
    assert job["registers"] <= 128
    if name == "rows":  # (the made-once form spills a few words with Triton 3.9, none on 3.6)
        assert job["spill_stores"] == 0
    assert 2 * (job["shared_bytes"] + 1024) <= 228 * 1024  # (1 KB an SM's program reserves)
    ptx = job["ptx"]
    # weights by TMA (words, scales), x by cp.async, the groups' counters read with acquire
    assert ptx["tma"] >= 2 and ptx["cp_async"] > 0 and ptx["acquire_loads"] > 0


def test_the_row_tile_probe_made_once_inputs_halve_the_mmas(compiled: dict) -> None:
    """With the group sums made by the copying warp, the consumers' constant-weight
    MMAs are gone: two MMAs a step instead of four."""
    assert _job(compiled, "rows")["ptx"]["mma"] == 2 * _job(compiled, "rows_pre")["ptx"]["mma"]


@pytest.mark.parametrize("name", ("decode_rows", "decode_rows_pre"))
def test_the_row_tile_decode_kernel_fits_two_programs_an_sm(compiled: dict, name: str) -> None:
    """With Llama-3-8B's input buffers and a ring of 4: two programs an SM at 128 registers."""
    job = _job(compiled, name)
    assert job["registers"] <= 128
    assert 2 * (job["shared_bytes"] + 1024) <= 228 * 1024
    ptx = job["ptx"]
    # weights by TMA, inputs by cp.async, the groups' counters read with acquire
    assert ptx["tma"] >= 2 and ptx["cp_async"] > 0 and ptx["acquire_loads"] > 0
    # a consumed slot is given back by one thread after a proxy fence and a barrier of the
    # consumer warps
    assert job["arrives"]["after_a_barrier"] > 0 and job["arrives"]["after_a_proxy_fence"] > 0


def test_the_row_tile_decode_kernels_inputs_made_once_halve_the_mmas(compiled: dict) -> None:
    """Its inputs' group sums made once by the phases that write them: no constant-weight MMAs
    left in the projections' steps (half of their MMAs; the other MMAs, attention's, the same
    in both forms); and in neither form a byte permute (the packed words' nibble order pairs
    adjacent inputs, as x's words hold them)."""
    plain, pre = _job(compiled, "decode_rows")["ptx"], _job(compiled, "decode_rows_pre")["ptx"]
    assert plain["mma_const_a"] > 0 and pre["mma_const_a"] == 0
    assert plain["mma"] - pre["mma"] == plain["mma_const_a"]
    assert pre["mma"] > 2 * plain["mma_const_a"]  # (the weight MMAs and attention's)
    assert plain["prmt"] == pre["prmt"] == 0


@pytest.mark.parametrize("name", JOBS)
def test_no_loop_carries_a_value_only_as_an_inner_loops_bound(compiled: dict,
                                                              name: str) -> None:
    """Triton 3.6 (the GPU machines') drops such a value, and the inner loop then keeps the
    value from before the outer loop: a kernel that waits on counts it miscounts hangs."""
    assert _job(compiled, name)["carried_bounds"] == []


# a loop carrying b (and a) to the next iteration, as Gluon's frontend writes it: b's only use
# is as the bound of the inner loop (through a cast); the second form also adds b to i
_CARRIED = ("    %i_2:3 = scf.for %f = %0 to %1 step %2 iter_args(%a_3 = %a, %b_4 = %b_1, "
            "%i_5 = %i) -> (i32, i32, i32)  : i32 {\n" + """\
      %a_18 = tt.load %a_17 : !tt.ptr<i32>
      %b_33 = tt.load %b_32 : !tt.ptr<i32>
      %4 = arith.bitcast %c0_i32 : i32 to i32
      %5 = arith.bitcast %b_4 : i32 to i32
      %i_36 = scf.for %c = %4 to %5 step %6 iter_args(%i_37 = %i_5) -> (i32)  : i32 {
        %i_38 = arith.addi %i_37, %a_3 : i32
        scf.yield %i_38 : i32
      }
      scf.yield %a_18, %b_33, %i_36 : i32, i32, i32
    }
    %5 = arith.addi %i_2#1, %c1_i32 : i32""")


def test_a_value_carried_only_as_a_loop_bound_is_found() -> None:
    from peregrine.testing.offline_compile import carried_bounds
    assert carried_bounds(_CARRIED) == ["line 1: %b_4"]
    other_use = _CARRIED.replace("scf.yield %a_18, %b_33, %i_36",
                                 "%i_39 = arith.addi %i_36, %b_4 : i32\n"
                                 "      scf.yield %a_18, %b_33, %i_39")
    assert carried_bounds(other_use) == []


def test_the_int4_steps_benchmark_runs_the_forms_it_names(compiled: dict) -> None:
    """An iteration is 8 steps of two words a warp: bf16 decodes a word with 3 shifts, the
    mul.hi form with 3 multiplies instead, fp16 with 1; with the zero point subtracted in the
    decode (bf16 or fp16) a step is its 2 weight MMAs and no sums; the warpgroup form issues 16
    weight MMAs and 16 sum MMAs, or with the zero point subtracted in the decode 16 and no sums; the
    8-bit form 8 integer MMAs (two a four words) and no shifts, compiled to as many IMMAs."""
    bf16, mulhi, fp16 = (_job(compiled, f"steps_{n}")["ptx"] for n in ("bf16", "mulhi", "fp16"))
    assert bf16["mma"] == mulhi["mma"] == fp16["mma"] == 32  # (16 weight, 16 sum MMAs)
    assert bf16["shr"] - fp16["shr"] == 8 * 2 * (3 - 1)
    assert bf16["shr"] - mulhi["shr"] == mulhi["mul_hi"] - bf16["mul_hi"] == 8 * 2 * 3
    sub, f16_sub = (_job(compiled, f"steps_{n}")["ptx"] for n in ("sub", "fp16_sub"))
    assert (sub["mma"], sub["mma_const_a"], sub["sub_bf16x2"]) == (16, 0, 8 * 2 * 4)
    assert sub["shr"] - bf16["shr"] <= 2  # (the same decode, and the stand-in zero points')
    assert (f16_sub["mma"], f16_sub["mma_const_a"]) == (16, 0)
    assert f16_sub["sub_f16x2"] == f16_sub["fma_f16x2"] == 8 * 2 * 2
    wg, hsub = _job(compiled, "steps_wgmma")["ptx"], _job(compiled, "steps_wgmma_hsub")["ptx"]
    assert (wg["mma"], wg["wgmma"], wg["sub_bf16x2"]) == (0, 32, 0)
    assert (hsub["wgmma"], hsub["sub_bf16x2"]) == (16, 16 * 4)
    imma = _job(compiled, "steps_imma")
    assert (imma["ptx"]["imma"], imma["ptx"]["mma"], imma["ptx"]["shr"]) == (8, 8, 0)
    assert imma["ops"].get("IMMA") == 8 and "HMMA" not in imma["ops"]
