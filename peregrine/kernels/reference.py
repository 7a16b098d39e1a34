"""Pure-torch references for every Triton kernel; they are the oracle in tests and the CPU path."""
from __future__ import annotations

import torch
import torch.nn.functional as F

# NOTE: the dense score matrix of one query chunk is (Hq, rows, L) fp32; chunking the queries of a
# long prefill bounds that memory without changing the result.
_QUERY_CHUNK = 512


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def quantize_kv_ref(x: torch.Tensor, cache_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """x as a cache of `cache_dtype` holds it: x * (1 / scale) in fp32, saturated to the finite
    range for FP8, then rounded to nearest even."""
    # NOTE: a multiply by the fp32 reciprocal, exactly what the store kernel computes, so the
    # two agree bit for bit (x / scale could round differently in the last place).
    y = x.float() * (1.0 / scale)
    if cache_dtype in FP8_DTYPES:
        fmax = torch.finfo(cache_dtype).max
        y = y.clamp(-fmax, fmax)
    return y.to(cache_dtype)


def dequantize_kv_ref(cache: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """The fp32 values a cache holding x / scale stands for."""
    return cache.float() * scale


def _bytes(cache: torch.Tensor) -> torch.Tensor:
    # NOTE: FP8 tensors are indexed through a uint8 view: index_put / gather need not support
    # float8 on every device.
    return cache.view(torch.uint8) if cache.dtype in FP8_DTYPES else cache


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write k / k_scale, v / v_scale (T, Hkv, D) into the paged caches at slot_mapping (T,);
    slot -1 is skipped."""
    block_size = k_cache.shape[1]
    valid = slot_mapping >= 0  # (T,)
    slots = slot_mapping[valid].long()  # (n,)
    blocks, offsets = slots // block_size, slots % block_size  # (n,), (n,)
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        _bytes(cache)[blocks, offsets] = _bytes(quantize_kv_ref(x[valid], cache.dtype, scale))


def gather_kv_ref(cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first seq_len tokens of one sequence from a paged cache, as (seq_len, Hkv, D)."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = block_table_row[:num_blocks].long()  # (nb,)
    return _bytes(cache)[blocks].view(cache.dtype).flatten(0, 1)[:seq_len]  # (seq_len, Hkv, D)


def attend_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               window: int | None = None) -> torch.Tensor:
    """Causal attention of q (n, Hq, D) at the LAST n positions of k/v (L, Hkv, D); fp32 result.
    With a sliding window, a query at position p sees keys p - window + 1 .. p."""
    n, num_q_heads, head_dim = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_q_heads // num_kv_heads
    # NOTE: viewing q heads as (Hkv, group) is the same as repeating each kv head `group` times
    # (q head h reads kv head h // group), without materialising the repeated K/V.
    qg = q.float().reshape(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # (Hkv, G, n, D)
    kf = k.float().permute(1, 0, 2).unsqueeze(1)  # (Hkv, 1, L, D)
    vf = v.float().permute(1, 0, 2).unsqueeze(1)  # (Hkv, 1, L, D)
    q_pos = torch.arange(seq_len - n, seq_len, device=q.device)  # (n,)
    k_pos = torch.arange(seq_len, device=q.device)  # (L,)
    out = torch.empty(n, num_q_heads, head_dim, dtype=torch.float32, device=q.device)  # (n, Hq, D)
    for c in range(0, n, _QUERY_CHUNK):
        rows = slice(c, min(c + _QUERY_CHUNK, n))
        scores = (qg[:, :, rows] @ kf.transpose(-1, -2)) * scale  # (Hkv, G, r, L)
        visible = k_pos[None, :] <= q_pos[rows, None]  # (r, L)
        if window is not None:
            visible &= k_pos[None, :] > q_pos[rows, None] - window
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)  # (Hkv, G, r, L)
        o = probs @ vf  # (Hkv, G, r, D)
        out[rows] = o.permute(2, 0, 1, 3).reshape(-1, num_q_heads, head_dim)
    return out


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_table: torch.Tensor, seq_lens: torch.Tensor,
                        query_start_loc: torch.Tensor, scale: float,
                        out: torch.Tensor | None = None,
                        window: int | None = None) -> torch.Tensor:
    """Causal paged attention for a packed batch; the tokens of sequence i are q[qsl[i]:qsl[i+1]].
    With a sliding window, a query at position p sees keys p - window + 1 .. p."""
    if out is None:
        out = torch.zeros_like(q)  # (T, Hq, D)
    # NOTE: a per-sequence loop needs host integers; this is the reference, so the sync is fine.
    seq_lens_h = seq_lens.tolist()
    qsl_h = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens_h):
        start, end = qsl_h[i], qsl_h[i + 1]
        if end <= start or seq_len <= 0:
            continue
        if end - start > seq_len:
            raise ValueError(f"sequence {i}: {end - start} new tokens but seq_len {seq_len}")
        k = gather_kv_ref(k_cache, block_table[i], seq_len)  # (L, Hkv, D)
        v = gather_kv_ref(v_cache, block_table[i], seq_len)  # (L, Hkv, D)
        out[start:end] = attend_ref(q[start:end], k, v, scale, window).to(out.dtype)
    return out


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """HF-style RMSNorm (normalise in fp32, cast, then scale); with residual: (out, x + residual)."""
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps)
    out = (h.to(x.dtype).float() * weight.float()).to(x.dtype)
    return out if residual is None else (out, x)


def apply_rope_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                   cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style RoPE (rotate halves of the first rotary_dim dims); returns new q, k."""
    rot = cos_sin_cache.shape[1]
    cos, sin = cos_sin_cache[positions.long()].float().chunk(2, dim=-1)  # (T, rot/2) each

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()  # (T, H, D)
        x1, x2 = xf[..., : rot // 2], xf[..., rot // 2: rot]  # (T, H, rot/2)
        c, s = cos[:, None, :], sin[:, None, :]
        rotated = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)  # (T, H, rot)
        return torch.cat([rotated, xf[..., rot:]], dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def norm_rope_store_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                        k_scale: float = 1.0, v_scale: float = 1.0,
                        q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                        eps: float = 1e-6) -> torch.Tensor:
    """Per-head RMSNorm of q and k (with weights), RoPE, k and v stored; returns the new q."""
    if q_weight is not None:
        q, k = rms_norm_ref(q, q_weight, eps), rms_norm_ref(k, k_weight, eps)
    q, k = apply_rope_ref(q, k, positions, cos_sin_cache)
    store_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :I]) * x[..., I:] for x (..., 2I), computed in fp32."""
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)
