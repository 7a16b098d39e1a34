"""The fused q/k norm + RoPE + K/V store kernel, compiled, at Qwen3-0.6B's and Llama-3-8B's
shapes: equal to the torch references (bf16 and FP8 caches), replayable in a CUDA graph, and
followed by decode attention that sees the K/V it stored also where it lets that kernel be
scheduled at its start."""
from __future__ import annotations

import pytest
import torch

from gpu_cases import ATTN_TOL, DEV, ELEM_TOL, attn_error, paged_inputs, rel_err
from peregrine.kernels import reference as ref
from peregrine.kernels.decode_attention import paged_decode_attention
from peregrine.kernels.rope_store import norm_rope_store

pytestmark = pytest.mark.gpu

DTYPE = torch.bfloat16
SHAPES = {"qwen3-0.6b": (16, 8, 128, True), "llama-3-8b": (32, 8, 128, False)}
BLOCK = 16


def _inputs(tokens: int, hq: int, hkv: int, head_dim: int, cache_dtype: torch.dtype):
    qkv = torch.randn(tokens, hq + 2 * hkv, head_dim, device=DEV, dtype=DTYPE) * 3
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]  # strided views, as the layer
    num_blocks = 2 * tokens // BLOCK + 1
    kc = torch.randn(num_blocks, BLOCK, hkv, head_dim, device=DEV).to(cache_dtype)
    vc = torch.randn_like(kc, dtype=torch.float32).to(cache_dtype)
    slots = torch.randperm(num_blocks * BLOCK, device=DEV)[:tokens]  # (T,)
    slots[::7] = -1  # padding tokens store nothing
    pos = torch.randint(0, 8192, (tokens,), device=DEV)  # (T,)
    inv = 1.0 / 1e6 ** (torch.arange(0, head_dim, 2, device=DEV).float() / head_dim)
    freqs = torch.outer(torch.arange(8192, device=DEV).float(), inv)  # (8192, D/2)
    cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # (8192, D)
    weights = [torch.rand(head_dim, device=DEV, dtype=DTYPE) + 0.5 for _ in range(2)]
    return q, k, v, pos, cache, kc, vc, slots, weights


@pytest.mark.parametrize("tokens", [1, 256, 4096])
@pytest.mark.parametrize("model", list(SHAPES))
@pytest.mark.parametrize("cache_dtype", [DTYPE, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_norm_rope_store_matches_reference(tokens: int, model: str,
                                           cache_dtype: torch.dtype) -> None:
    hq, hkv, d, qk_norm = SHAPES[model]
    q, k, v, pos, cache, kc, vc, slots, (qw, kw) = _inputs(tokens, hq, hkv, d, cache_dtype)
    norm = dict(q_weight=qw, k_weight=kw, eps=1e-6) if qk_norm else {}
    scales = (0.5, 1.5) if cache_dtype != DTYPE else (1.0, 1.0)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    q_ref = ref.norm_rope_store_ref(q, k, v, pos, cache, kc_ref, vc_ref, slots, *scales, **norm)
    norm_rope_store(q, k, v, pos, cache, kc, vc, slots, *scales, **norm)
    assert rel_err(q, q_ref) <= ELEM_TOL
    assert torch.equal(vc.view(torch.uint8), vc_ref.view(torch.uint8))
    if cache_dtype == DTYPE:
        assert rel_err(kc, kc_ref) <= ELEM_TOL
    else:  # an ulp of bf16 k may land on the next FP8 value: one FP8 step at most
        assert rel_err(kc.float(), kc_ref.float()) <= 2 ** -3
    # slots no token wrote keep their bytes
    written = torch.zeros(kc.shape[0] * BLOCK, dtype=torch.bool, device=DEV)
    written[slots[slots >= 0]] = True
    assert torch.equal(kc.flatten(0, 1)[~written].view(torch.uint8),
                       kc_ref.flatten(0, 1)[~written].view(torch.uint8))


def test_norm_rope_store_replays_in_a_cuda_graph_with_new_inputs() -> None:
    hq, hkv, d, _ = SHAPES["qwen3-0.6b"]
    q, k, v, pos, cache, kc, vc, slots, (qw, kw) = _inputs(64, hq, hkv, d, DTYPE)
    q0, k0, v0 = q.clone(), k.clone(), v.clone()
    norm_rope_store(q, k, v, pos, cache, kc, vc, slots, q_weight=qw, k_weight=kw)  # warm-up
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        norm_rope_store(q, k, v, pos, cache, kc, vc, slots, q_weight=qw, k_weight=kw)
    # new positions, slots and q/k/v written into the captured tensors
    pos.copy_(torch.randint(0, 8192, pos.shape, device=DEV))
    slots.copy_(torch.randperm(kc.shape[0] * BLOCK, device=DEV)[:slots.shape[0]])
    q.copy_(q0 * 2)
    k.copy_(k0 - 1)
    v.copy_(v0 + 1)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    q_ref = ref.norm_rope_store_ref(q, k, v, pos, cache, kc_ref, vc_ref, slots, q_weight=qw,
                                    k_weight=kw)
    g.replay()
    torch.cuda.synchronize()
    assert rel_err(q, q_ref) <= ELEM_TOL
    assert rel_err(kc, kc_ref) <= ELEM_TOL
    assert torch.equal(vc, vc_ref)


@pytest.mark.parametrize("lens", [[200], [57, 129, 16, 300]], ids=["batch1", "batch4"])
@pytest.mark.parametrize("gemv_projections", [True, False], ids=["release", "no-release"])
def test_decode_attention_after_the_store_sees_the_stored_token(lens, gemv_projections) -> None:
    """Llama-3-8B's heads, decode rows: the store (releasing the split kernel at its start when
    GEMVs follow) then paged decode attention, captured in a CUDA graph and replayed with new
    K/V, lengths, positions and slots each time (the kernels read the step's inputs before their
    waits at these batches); the output is attention over the cache as the store left it."""
    hq, hkv, d, _ = SHAPES["llama-3-8b"]
    batch = len(lens)
    _, kc, vc, table, seq_lens, qsl = paged_inputs(lens, [1] * batch, hq, hkv, d, DTYPE,
                                                   width=32)
    full = seq_lens.clone()
    last = seq_lens.long() - 1  # this step's token: its position and slot
    slots = table.long().gather(1, (last // BLOCK)[:, None])[:, 0] * BLOCK + last % BLOCK
    qkv = torch.randn(batch, hq + 2 * hkv, d, device=DEV, dtype=DTYPE)
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    q_out, out = torch.empty(batch, hq, d, device=DEV, dtype=DTYPE), torch.empty(
        batch, hq, d, device=DEV, dtype=DTYPE)
    inv = 1.0 / 5e5 ** (torch.arange(0, d, 2, device=DEV).float() / d)
    freqs = torch.outer(torch.arange(1024, device=DEV).float(), inv)
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # (1024, D)

    def step():
        norm_rope_store(q, k, v, last, cos_sin, kc, vc, slots, q_out=q_out,
                        gemv_projections=gemv_projections)
        paged_decode_attention(q_out, kc, vc, table, seq_lens, d ** -0.5, out=out)

    step()  # compiles
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for i in range(6):
        if i:  # another step: new lengths within each sequence's own blocks, the token's
            # position and slot with them
            seq_lens.copy_((torch.rand(batch, device=DEV) * full).to(seq_lens.dtype) + 1)
            last.copy_(seq_lens.long() - 1)
            slots.copy_(table.long().gather(1, (last // BLOCK)[:, None])[:, 0] * BLOCK
                        + last % BLOCK)
        qkv.copy_(torch.randn_like(qkv) * 2)
        kc_ref, vc_ref = kc.clone(), vc.clone()
        q_ref = ref.norm_rope_store_ref(q.clone(), k, v, last, cos_sin, kc_ref, vc_ref, slots)
        g.replay()
        torch.cuda.synchronize()
        assert rel_err(kc, kc_ref) <= ELEM_TOL and torch.equal(vc, vc_ref)
        assert rel_err(q_out, q_ref) <= ELEM_TOL
        err = attn_error(out, q_out, kc, vc, table, seq_lens, qsl, d ** -0.5)
        assert err <= ATTN_TOL[DTYPE], f"replay {i}: {err}"
