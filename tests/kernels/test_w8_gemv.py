"""The small-batch GEMV for 8-bit weights (under Triton's interpreter, tiny shapes): FP8 e4m3 with
per-channel, per-tensor and block scales and int8 with per-channel scales, multiplied by x as it
is, equal dequantize-then-matmul (the reference of the weight-only small-batch path)."""
from __future__ import annotations

import pytest
import torch

from peregrine.kernels.fp8_quant import FP8_DTYPE, block_dequantize
from peregrine.kernels.gemv import GemvConfig, w8_gemv, w8_gemv_supported
from peregrine.testing import fp8_pack

K, N = 256, 64


def _weight(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) quantized per channel and its (1, N) float32 scales, as W8A8Method stores them."""
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) * 0.02
    wq, ws = fp8_pack.quantize_per_channel(w, dtype)  # (N, K), (N, 1)
    return wq, ws.t().contiguous()


def _fp8_weight(block: tuple[int, int] | None, seed: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N, K) FP8 with (1, N) per-channel scales (block None) or block scales, and the
    dequantized (N, K) float32 weight."""
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) * 0.02
    if block is None:
        wq, ws = fp8_pack.quantize_per_channel(w, FP8_DTYPE)
        return wq, ws.t().contiguous(), wq.float() * ws
    wq, ws = fp8_pack.quantize_blocks(w, block)
    return wq, ws, block_dequantize(wq, ws, block)


def _x(m: int, dtype: torch.dtype = torch.float32, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, K, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("dtype", [FP8_DTYPE, torch.int8], ids=["fp8", "int8"])
def test_per_channel_matches_dequantized_matmul(dtype: torch.dtype, m: int) -> None:
    wq, ws = _weight(dtype)
    x = _x(m)
    want = x @ (wq.float() * ws.t()).t()  # (M, N)
    got = w8_gemv(x, wq, ws)
    assert got.shape == (m, N) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_per_tensor_scale_is_one_scale_for_every_channel() -> None:
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(2)) * 0.02
    scale = (w.abs().max() / 448).reshape(1, 1)
    wq = (w / scale).clamp(-448, 448).to(FP8_DTYPE)
    x = _x(2)
    got = w8_gemv(x, wq, scale.expand(1, N))
    torch.testing.assert_close(got, x @ (wq.float() * scale).t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block", [(32, 64), (128, 128), (16, 32)])
def test_block_scales_match_block_dequantize(block: tuple[int, int]) -> None:
    wq, ws = fp8_pack.quantize_blocks(
        torch.randn(N, K, generator=torch.Generator().manual_seed(3)) * 0.02, block)
    x = _x(3, seed=4)
    want = x @ block_dequantize(wq, ws, block).t()
    torch.testing.assert_close(w8_gemv(x, wq, ws, block), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_16_bit_activations_round_only_the_output(dtype: torch.dtype) -> None:
    wq, ws = _weight(FP8_DTYPE, seed=5)
    x = _x(4, dtype)
    got = w8_gemv(x, wq, ws)
    want = x.float() @ (wq.float() * ws.t()).t()
    assert got.dtype == dtype
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3  # the interpreter truncates bf16
    assert ((got.float() - want).abs() / want.abs().max()).max() < tol


@pytest.mark.parametrize("split", [2, 4])
def test_split_k_adds_every_split_and_repeats_bit_for_bit(split: int) -> None:
    wq, ws = _weight(torch.int8, seed=6)
    x = _x(5, seed=7)
    cfg = GemvConfig(block_n=16, block_k=64, split_k=split, k_iters=4 // split, num_warps=4)
    first = w8_gemv(x, wq, ws, config=cfg)
    torch.testing.assert_close(first, x @ (wq.float() * ws.t()).t(), rtol=1e-5, atol=1e-5)
    assert torch.equal(first, w8_gemv(x, wq, ws, config=cfg))


@pytest.mark.parametrize("block", [None, (32, 64)], ids=["channel", "blocks"])
def test_prefetch_gives_the_same_bits(block) -> None:
    # 3 splits of 2 blocks of 64 over K = 256 (4 blocks): the last split's loads ahead run past K
    wq, ws, want_w = _fp8_weight(block, seed=8)
    x = _x(2, seed=9)
    cfg = GemvConfig(block_n=16, block_k=64, split_k=3, k_iters=2, num_warps=4)
    plain = w8_gemv(x, wq, ws, block, config=cfg)
    assert torch.equal(w8_gemv(x, wq, ws, block, config=cfg, prefetch=True), plain)
    torch.testing.assert_close(plain, x @ want_w.t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", [0, 1])
@pytest.mark.parametrize("block", [None, (32, 64)], ids=["channel", "blocks"])
def test_both_k_loop_forms_match_dequantized_matmul(block, form: int) -> None:
    # the block reduced every block (0) or per-thread sums of 16 adjacent k (1): split, several
    # rows, prefetch
    wq, ws, want_w = _fp8_weight(block, seed=10)
    x = _x(3, seed=11)
    cfg = GemvConfig(block_n=16, block_k=64, split_k=2, k_iters=2, num_warps=4)
    got = w8_gemv(x, wq, ws, block, config=cfg, form=form)
    torch.testing.assert_close(got, x @ want_w.t(), rtol=1e-5, atol=1e-5)
    assert torch.equal(w8_gemv(x, wq, ws, block, config=cfg, prefetch=True, form=form), got)
    # NOTE: the two forms add in different orders: close, not the same bits
    assert (got - w8_gemv(x, wq, ws, block, config=cfg, form=1 - form)).abs().max() < 1e-5


@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block", [None, (32, 64)], ids=["channel", "blocks"])
def test_gated_rows_equal_the_activation_kernel_then_the_gemv(block, dtype: torch.dtype,
                                                                m: int) -> None:
    from peregrine.kernels.activation import silu_and_mul
    wq, ws, _ = _fp8_weight(block, seed=12)
    h = torch.randn(m, 2 * K, generator=torch.Generator().manual_seed(13)).to(dtype)
    cfg = GemvConfig(block_n=16, block_k=64, split_k=2, k_iters=2, num_warps=4)
    got = w8_gemv(h, wq, ws, block, config=cfg, gated=True)
    assert torch.equal(got, w8_gemv(silu_and_mul(h), wq, ws, block, config=cfg))
    with pytest.raises(ValueError, match="gated: twice its inputs"):
        w8_gemv(h[:, :K], wq, ws, block, gated=True)


def test_bad_inputs_are_named() -> None:
    wq, ws = _weight(FP8_DTYPE)
    with pytest.raises(ValueError, match="does not match the weight"):
        w8_gemv(torch.zeros(1, K + 1), wq, ws)
    with pytest.raises(ValueError, match="per-channel scales"):
        w8_gemv(torch.zeros(1, K), wq, ws[:, :3])
    with pytest.raises(ValueError, match="block scales"):
        w8_gemv(torch.zeros(1, K), wq, torch.ones(1, 1), (128, 128))
    with pytest.raises(ValueError, match="not supported"):
        w8_gemv(torch.zeros(1, K), wq.float(), ws)
    with pytest.raises(ValueError, match="form 2"):
        w8_gemv(torch.zeros(1, K), wq, ws, form=2)
    with pytest.raises(ValueError, match="block_k 8"):
        w8_gemv(torch.zeros(1, K), wq, ws, config=GemvConfig(16, 8, 1, 32, 4), form=1)
    assert not w8_gemv_supported(wq.t())  # column-major
    assert not w8_gemv_supported(wq, (128, 24))


@pytest.mark.slow
@pytest.mark.parametrize("scheme, act", [("int8_dynamic", torch.int8),
                                         ("fp8_dynamic", FP8_DTYPE)], ids=["int8", "fp8"])
def test_engine_decode_steps_take_weight_only_math(tmp_path, monkeypatch, scheme: str,
                                                   act: torch.dtype) -> None:
    """The CUDA dispatch (GEMV at most W8_GEMV_MAX_M rows) run here through the interpreter: the
    greedy tokens' logprobs follow the reference that rounds only the prompt's linear inputs."""
    import peregrine.layers.quantization.fp8 as fp8_mod
    import peregrine.layers.quantization.int8 as int8_mod
    from peregrine.kernels.gemv import W8_GEMV_MAX_M
    from peregrine.testing.checkpoints import tiny_checkpoint
    taken = []

    def small(x: torch.Tensor, max_m: int) -> bool:
        assert max_m == W8_GEMV_MAX_M  # the 8-bit methods ask with their own cut-off
        taken.append(0 < x.numel() // x.shape[-1] <= max_m)
        return taken[-1]

    for mod in (fp8_mod, int8_mod):
        monkeypatch.setattr(mod, "use_gemv", small)
        monkeypatch.setattr(mod, "w8_gemv_ready", lambda w, block=None: True)
    src = tiny_checkpoint("qwen3", dtype=torch.bfloat16)
    path = fp8_pack.write_compressed_tensors(src, tmp_path / "ct", scheme)
    scores = fp8_pack.score_generation(path, tmp_path / "ct-reference", act,
                                       decode_unrounded=True)
    assert any(taken) and not all(taken)  # decode steps took the GEMV, prompt chunks did not
    q, ref = torch.tensor(scores["quantized"]), torch.tensor(scores["reference_rounded"])
    assert (q - ref).abs().max() < 0.2 and (q - ref).abs().mean() < 0.06, (q - ref).tolist()


def test_one_row_of_a_wide_projection_is_not_split(monkeypatch) -> None:
    """One row with per-channel scales: where 16-column tiles fill the SMs and the default would
    split K, the config is 16-column tiles, no split, 8 warps, with a K block wide enough for
    the programs an SM runs to ask for 32 KB an iteration, if a program then reads at most 7
    blocks; everything else keeps the default tile (two rows, block scales, projections too
    narrow or too long along K, or a default that does not split)."""
    import peregrine.kernels.gemv as g
    cuda = torch.device("cuda")
    monkeypatch.setattr(g, "num_sms", lambda device: 132)
    # Llama-3-8B: qkv (2.9 programs an SM), o (1.94), the down projection (1.94, K 14336).
    assert g.w8_gemv_config(1, 6144, 4096, None, cuda) == GemvConfig(16, 1024, 1, 4, 8)
    assert g.w8_gemv_config(1, 4096, 4096, None, cuda) == GemvConfig(16, 2048, 1, 2, 8)
    assert g.w8_gemv_config(1, 4096, 14336, None, cuda) == GemvConfig(16, 2048, 1, 7, 8)
    # Llama-2-70B's qkv, o and down (16, 8 and 14 blocks at their widths), two rows, block
    # scales, a projection too narrow for 16-column tiles, gate/up (its default is unsplit).
    for m, n, k, block in ((1, 10240, 8192, None), (1, 8192, 8192, None),
                           (1, 8192, 28672, None), (2, 6144, 4096, None),
                           (1, 6144, 4096, (128, 128)), (1, 3584, 3584, None),
                           (1, 28672, 4096, None)):
        cfg = g.w8_gemv_config(m, n, k, block, cuda)
        assert cfg.block_n == 32 and cfg.num_warps == 4, (m, n, k, block)
    assert g.w8_gemv_config(1, 28672, 4096, None, cuda).split_k == 1
    monkeypatch.setattr(g, "_W8_NARROW_MAX_BLOCK_K", 512)
    monkeypatch.setattr(g, "_W8_NARROW_K_ITERS", 8)
    assert g.w8_gemv_config(1, 4096, 4096, None, cuda) == GemvConfig(16, 512, 1, 8, 8)
    assert g.w8_gemv_config(1, 4096, 14336, None, cuda).block_n == 32
    monkeypatch.setattr(g, "_W8_NARROW_WAVES", 0)
    assert g.w8_gemv_config(1, 6144, 4096, None, cuda).block_n == 32


@pytest.mark.parametrize("block_k", [512, 2048])
def test_the_unsplit_wide_tile_matches_dequantized_matmul(block_k: int) -> None:
    """The unsplit tile's K block is wider than this weight's K: the rest is masked; the gated
    form too."""
    from peregrine.kernels.activation import silu_and_mul
    wq, ws = _weight(FP8_DTYPE)
    x = _x(1)
    cfg = GemvConfig(block_n=16, block_k=block_k, split_k=1, k_iters=1, num_warps=8)
    want = x @ (wq.float() * ws.t()).t()
    torch.testing.assert_close(w8_gemv(x, wq, ws, config=cfg), want, rtol=1e-5, atol=1e-5)
    h = torch.randn(1, 2 * K, generator=torch.Generator().manual_seed(3))
    assert torch.equal(w8_gemv(h, wq, ws, config=cfg, gated=True),
                       w8_gemv(silu_and_mul(h), wq, ws, config=cfg))


# (form 0, the reduce-every-block form, in the full suite only: the default is 1)
@pytest.mark.parametrize("form", [pytest.param(0, marks=pytest.mark.slow), 1])
@pytest.mark.parametrize("block_k, split", [(64, 1), (512, 1), (64, 2), (32, 8)])
@pytest.mark.parametrize("dtype", [FP8_DTYPE, torch.int8], ids=["fp8", "int8"])
def test_normed_row_is_the_rms_norm_then_the_gemv(dtype: torch.dtype, block_k: int, split: int,
                                                  form: int) -> None:
    """norm=(weight, eps): one row h of the residual stream, the GEMV's input RMSNorm(h) *
    weight, the squares summed over the K loop's blocks (several, or one wider than K), 1 / rms
    applied to the sums; a split launch's last program of a column tile adds the splits'
    squares: float32 RMSNorm then dequantize-then-matmul."""
    wq, ws = _weight(dtype, seed=6)
    g = torch.Generator().manual_seed(7)
    h = torch.randn(1, K, generator=g) * 3
    nw = torch.rand(K, generator=g) + 0.5
    iters = -(-K // (block_k * split))
    cfg = GemvConfig(block_n=16, block_k=block_k, split_k=split, k_iters=iters, num_warps=4)
    got = w8_gemv(h, wq, ws, config=cfg, form=form, norm=(nw, 1e-5))
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * nw
    want = normed @ (wq.float() * ws.t()).t()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if split > 1:  # the same bits again (the split order is fixed)
        assert torch.equal(got, w8_gemv(h, wq, ws, config=cfg, form=form, norm=(nw, 1e-5)))
    # eps is used: a zero row gives zeros, not NaN
    assert torch.equal(w8_gemv(torch.zeros(1, K), wq, ws, config=cfg, norm=(nw, 1e-5)),
                       torch.zeros(1, N))


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("split", [1, 4])
def test_residual_rows_are_the_gemv_then_the_norm_kernels_add(split: int, gated: bool) -> None:
    """residual=: the output is residual + the product, bit for bit what the GEMV and then the
    norm kernel's residual add give (bf16), unsplit and through the split-K finish, gated too."""
    from peregrine.kernels.rmsnorm import rms_norm
    wq, ws = _weight(FP8_DTYPE, seed=8)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, 2 * K if gated else K, generator=g).to(torch.bfloat16)
    res = torch.randn(2, N, generator=g).to(torch.bfloat16)
    cfg = GemvConfig(block_n=32, block_k=64, split_k=split, k_iters=4 // split, num_warps=4)
    got = w8_gemv(x, wq, ws, config=cfg, gated=gated, residual=res)
    y = w8_gemv(x, wq, ws, config=cfg, gated=gated)
    _, want = rms_norm(y, torch.ones(N, dtype=torch.bfloat16), 1e-6, residual=res)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert not torch.equal(got, y)


@pytest.mark.parametrize("block", [None, (16, 64)])
@pytest.mark.parametrize("normed", [False, True])
@pytest.mark.parametrize("block_n", [16, 32])
def test_silu_out_is_the_gemv_then_the_activation_kernel(block_n: int, normed: bool,
                                                          block) -> None:
    """silu_out=True: a gate-and-up weight (N / 2 gate rows, then their up rows), the output
    silu(gate) * up (1, N / 2), bit for bit the GEMV (normed or not) and then the activation
    kernel (bf16)."""
    from peregrine.kernels.activation import silu_and_mul
    wq, ws, _ = _fp8_weight(block, seed=14)
    g = torch.Generator().manual_seed(15)
    h = (torch.randn(1, K, generator=g) * 3).to(torch.bfloat16)
    nw = (torch.rand(K, generator=g) + 0.5).to(torch.bfloat16)
    norm = (nw, 1e-5) if normed else None
    cfg = GemvConfig(block_n=block_n, block_k=64, split_k=1, k_iters=K // 64, num_warps=4)
    got = w8_gemv(h, wq, ws, block, config=cfg, norm=norm, silu_out=True)
    want = silu_and_mul(w8_gemv(h, wq, ws, block, config=cfg, norm=norm))
    assert got.shape == (1, N // 2) and got.dtype == torch.bfloat16
    assert torch.equal(got, want)
    # the pairs are gate c with up c: swapping the halves' rows changes the result
    swapped = torch.cat([wq[N // 2:], wq[:N // 2]])
    ws_swapped = ws if block is not None else torch.cat([ws[:, N // 2:], ws[:, :N // 2]], 1)
    assert not torch.equal(got, w8_gemv(h, swapped, ws_swapped, block, config=cfg, norm=norm,
                                        silu_out=True))


def test_silu_out_with_an_odd_tile_count_and_misuse() -> None:
    """N / 2 not a multiple of the tile's half (the last tile masked); silu_out refuses rows,
    residual and split launches by name."""
    from peregrine.kernels.activation import silu_and_mul
    wq, ws = _weight(FP8_DTYPE, seed=16)
    wq, ws = torch.cat([wq[:24], wq[32:56]]), torch.cat([ws[:, :24], ws[:, 32:56]], 1)  # N 48
    h = torch.randn(1, K, generator=torch.Generator().manual_seed(17)).to(torch.bfloat16)
    for block_n in (32, 16):  # a last tile half past N / 2 (row masks), then whole tiles
        cfg = GemvConfig(block_n=block_n, block_k=128, split_k=1, k_iters=2, num_warps=4)
        got = w8_gemv(h, wq, ws, config=cfg, silu_out=True)
        assert got.shape == (1, 24)
        assert torch.equal(got, silu_and_mul(w8_gemv(h, wq, ws, config=cfg)))
    split = GemvConfig(block_n=16, block_k=64, split_k=2, k_iters=2, num_warps=4)
    with pytest.raises(ValueError, match="silu_out"):
        w8_gemv(torch.zeros(2, K), wq, ws, silu_out=True)
    with pytest.raises(ValueError, match="silu_out"):
        w8_gemv(h, wq, ws, config=split, silu_out=True)
    with pytest.raises(ValueError, match="silu_out"):
        w8_gemv(h, wq, ws, residual=torch.zeros(1, 48, dtype=torch.bfloat16), silu_out=True)


@pytest.mark.parametrize("block", [(32, 64), (16, 32)])
def test_normed_row_with_block_scales(block: tuple[int, int]) -> None:
    """The normalised row through block-scaled FP8 weights, split and not: float32 RMSNorm then
    block_dequantize-then-matmul."""
    wq, ws, w = _fp8_weight(block, seed=12)
    g = torch.Generator().manual_seed(13)
    h = torch.randn(1, K, generator=g) * 2
    nw = torch.rand(K, generator=g) + 0.5
    want = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * nw) @ w.t()
    for split in (1, 4):
        cfg = GemvConfig(block_n=32, block_k=block[1], split_k=split,
                         k_iters=-(-K // (block[1] * split)), num_warps=4)
        got = w8_gemv(h, wq, ws, block, config=cfg, norm=(nw, 1e-6))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_norm_and_residual_misuse_is_named() -> None:
    """norm takes one row, no gate, a (K,) weight, at most 32 splits; residual must be (M, N)
    in x's dtype."""
    from peregrine.kernels.gemv import w8_gemv_takes_norm
    wq, ws = _weight(FP8_DTYPE)
    nw = torch.ones(K)
    split = GemvConfig(block_n=32, block_k=16, split_k=64, k_iters=1, num_warps=4)
    with pytest.raises(ValueError, match="one row"):
        w8_gemv(torch.zeros(2, K), wq, ws, norm=(nw, 1e-6))
    with pytest.raises(ValueError, match="split 64"):
        w8_gemv(torch.zeros(1, K), wq, ws, config=split, norm=(nw, 1e-6))
    with pytest.raises(ValueError, match="gated True"):
        w8_gemv(torch.zeros(1, 2 * K), wq, ws, gated=True, norm=(nw, 1e-6))
    with pytest.raises(ValueError, match="norm weight"):
        w8_gemv(torch.zeros(1, K), wq, ws, norm=(torch.ones(K + 1), 1e-6))
    with pytest.raises(ValueError, match="residual"):
        w8_gemv(torch.zeros(1, K), wq, ws, residual=torch.zeros(1, N + 1))
    with pytest.raises(ValueError, match="residual"):
        w8_gemv(torch.zeros(1, K), wq, ws, residual=torch.zeros(1, N, dtype=torch.bfloat16))
    assert w8_gemv_takes_norm(1) and not w8_gemv_takes_norm(2)


@pytest.mark.slow
def test_engine_decode_rows_take_the_norms_into_the_gemvs(tmp_path, monkeypatch) -> None:
    """The CUDA dispatch run here through the interpreter (one decode row per step, float32): with
    the norms taken into the 8-bit GEMVs (the output and down projections add the residual, qkv
    and gate/up normalise their input, gate/up writes the activation), the generated tokens and
    their logprobs are those of the separate norm kernels within float32 rounding; every decode
    step took the fused forms and prompt chunks did not."""
    import peregrine.kernels.gemv as gemv
    import peregrine.layers.quantization.fp8 as fp8_mod
    import peregrine.models.decoder as decoder
    from peregrine import LLM, SamplingParams
    from peregrine.layers.kernel_config import KernelConfig
    from peregrine.testing.checkpoints import tiny_checkpoint
    calls = {"norm": 0, "residual": 0, "plain": 0, "silu_out": 0}
    kernel = gemv.w8_gemv

    def counted(x, *args, norm=None, residual=None, silu_out=False, **kw):
        calls["norm" if norm is not None else "residual" if residual is not None
              else "plain"] += 1
        calls["silu_out"] += silu_out
        return kernel(x, *args, norm=norm, residual=residual, silu_out=silu_out, **kw)

    monkeypatch.setattr(fp8_mod, "use_gemv", lambda x, max_m: 0 < x.numel() // x.shape[-1]
                        <= max_m)
    monkeypatch.setattr(fp8_mod, "w8_gemv_ready", lambda w, block=None: True)
    monkeypatch.setattr(fp8_mod, "w8_gemv", counted)
    # the model built with the Triton norm, RoPE and activation kernels, as on CUDA
    monkeypatch.setattr(KernelConfig, "for_device", classmethod(lambda cls, d: cls(fused=True)))
    src = tiny_checkpoint("llama", dtype=torch.float32)
    path = fp8_pack.write_compressed_tensors(src, tmp_path / "ct", "fp8_dynamic")
    prompts = [[(7 * i + 3) % 500 + 4 for i in range(20)], [5, 9, 300, 301]]
    sp = SamplingParams(temperature=0.0, max_tokens=5, logprobs=1, ignore_eos=True)
    runs = {}
    for fuse in (True, False):
        monkeypatch.setattr(decoder, "FUSE_NORMS", fuse)
        before = dict(calls)
        llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, max_model_len=128,
                  seed=0, enforce_eager=True, max_num_batched_tokens=16)
        outs = [llm.generate([p], sp, use_tqdm=False)[0].outputs[0] for p in prompts]
        del llm
        runs[fuse] = (outs, {k: calls[k] - before[k] for k in calls})
    (fused, fused_calls), (plain, plain_calls) = runs[True], runs[False]
    # tiny llama: two layers of two such linears each; four decode steps of one row per prompt
    per_kind = 2 * 2 * 4 * len(prompts)
    # gate/up writes silu(gate) * up itself: the down projection then reads it plainly
    assert fused_calls == {"norm": per_kind, "residual": per_kind, "plain": 0,
                           "silu_out": per_kind // 2}, fused_calls
    assert plain_calls == {"norm": 0, "residual": 0, "plain": 2 * per_kind,
                           "silu_out": 0}, plain_calls
    for a, b in zip(fused, plain):
        assert a.token_ids == b.token_ids
        la = torch.tensor([a.logprobs[i][t].logprob for i, t in enumerate(a.token_ids)])
        lb = torch.tensor([b.logprobs[i][t].logprob for i, t in enumerate(b.token_ids)])
        torch.testing.assert_close(la, lb, rtol=0, atol=1e-4)
