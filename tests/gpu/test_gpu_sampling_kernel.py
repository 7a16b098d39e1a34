"""The compiled sampling kernel draws the torch formula's tokens at Qwen3's vocabulary (CUDA)."""
from __future__ import annotations

import pytest
import torch

from gpu_cases import DEV
from peregrine.kernels.sampling import argmax_rows, gumbel_argmax
from peregrine.sample.noise import as_int32_bits, log_exponentials, row_keys, token_hashes

pytestmark = pytest.mark.gpu

VOCAB = 151_936  # Qwen3
BATCHES = [1, 64, 256]
# Row settings of the sampler's workloads: temperature, and the kept-token threshold as a
# quantile of logit/T (None: keep all, as W1's T=0.6; 0.999: a top-p/top-k/min-p style cut).
SETTINGS = {"T=0.6": (0.6, None), "greedy": (0.0, None), "T=0.7 top": (0.7, 0.999),
            "T=1.0 min": (1.0, 0.9)}


def _rows(batch: int, temperature: float, keep_quantile: float | None,
          dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    """(logits (B, V), temperature, seeds, steps, threshold or None) on the GPU."""
    gen = torch.Generator().manual_seed(batch)
    logits = (torch.randn(batch, VOCAB, generator=gen) * 3).to(dtype).to(DEV)  # (B, V)
    temp = torch.full((batch,), temperature, device=DEV)  # (B,)
    seeds = torch.randint(-2**63, 2**63 - 1, (batch,), generator=gen).to(DEV)  # (B,)
    steps = torch.randint(0, 1000, (batch,), generator=gen).to(DEV)  # (B,)
    thr = None
    if keep_quantile is not None:
        xt = logits.float() / temperature  # (B, V)
        thr = xt.kthvalue(int(keep_quantile * VOCAB), dim=-1).values  # (B,)
    return logits, temp, seeds, steps, thr


def _table(device: torch.device) -> torch.Tensor:
    return as_int32_bits(token_hashes(torch.arange(VOCAB, device=device)))  # (V,)


def _torch_draw(logits: torch.Tensor, temp: torch.Tensor, seeds: torch.Tensor,
                steps: torch.Tensor, thr: torch.Tensor | None) -> torch.Tensor:
    """The sampler's pure-torch formula: argmax of logit/T - log(-log u) over kept tokens."""
    x = logits.float()  # (B, V)
    greedy = temp == 0
    xt = x / torch.where(greedy, 1.0, temp).unsqueeze(-1)  # (B, V)
    keys = row_keys(seeds, steps).unsqueeze(-1)  # (B, 1)
    hashes = token_hashes(torch.arange(x.shape[-1], device=x.device)).unsqueeze(0)  # (1, V)
    scores = xt - log_exponentials(keys, hashes)  # (B, V)
    if thr is not None:
        scores.masked_fill_(xt < thr.unsqueeze(-1), float("-inf"))
    return torch.where(greedy, x.argmax(-1), scores.argmax(-1))


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_kernel_draws_the_torch_tokens(setting: str, batch: int) -> None:
    """Same noise (libdevice's logf is torch's), same thresholds: the same token on every row.
    NOTE: 1% of rows may differ, as for an ulp-level tie between two scores."""
    rows = _rows(batch, *SETTINGS[setting])
    got = gumbel_argmax(*rows[:4], _table(DEV), rows[4])
    want = _torch_draw(*rows)
    assert int((got != want).sum()) <= 0.01 * batch


def test_greedy_and_sampled_rows_in_one_batch() -> None:
    logits, temp, seeds, steps, thr = _rows(64, 0.6, 0.99)
    temp[::2] = 0.0  # greedy rows ignore the threshold and the noise
    got = gumbel_argmax(logits, temp, seeds, steps, _table(DEV), thr)
    assert torch.equal(got[::2], logits[::2].argmax(-1))
    assert int((got != _torch_draw(logits, temp, seeds, steps, thr)).sum()) <= 0.01 * 64


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_logits_draw_their_float32_tokens(dtype: torch.dtype) -> None:
    rows = _rows(64, 0.6, None, dtype)
    got = gumbel_argmax(*rows[:4], _table(DEV))
    want = _torch_draw(rows[0].float(), *rows[1:])
    assert int((got != want).sum()) <= 0.01 * 64


def test_noise_alone_decides_under_flat_logits() -> None:
    """Flat logits: the token is the noise's argmin, so any hash or log difference shows."""
    logits = torch.zeros(256, VOCAB, device=DEV)  # (B, V)
    temp = torch.ones(256, device=DEV)
    seeds = torch.arange(256, device=DEV) * 1_000_003 - 2**40
    steps = torch.arange(256, device=DEV) * 7
    got = gumbel_argmax(logits, temp, seeds, steps, _table(DEV))
    assert int((got != _torch_draw(logits, temp, seeds, steps, None)).sum()) <= 0.01 * 256
    assert len(set(got.tolist())) > 200  # the rows really draw different tokens


@pytest.mark.parametrize("batch", [64, 256])
def test_kernel_matches_a_cpu_torch_draw(batch: int) -> None:
    """The first 8 rows, drawn by the torch formula on the CPU (a different log implementation)."""
    rows = _rows(batch, 0.6, 0.99)
    got = gumbel_argmax(*rows[:4], _table(DEV), rows[4])[:8].cpu()
    want = _torch_draw(*(t[:8].cpu() for t in rows))
    assert torch.equal(got, want)


@pytest.mark.parametrize("batch", [64, 256])
def test_a_row_alone_draws_its_in_batch_token(batch: int) -> None:
    """The launch shape (chunks per row) changes with the batch; the token must not."""
    logits, temp, seeds, steps, thr = _rows(batch, 0.6, 0.99)
    table = _table(DEV)
    in_batch = gumbel_argmax(logits, temp, seeds, steps, table, thr)
    for i in range(0, batch, batch // 4):
        alone = gumbel_argmax(logits[i:i + 1], temp[i:i + 1], seeds[i:i + 1], steps[i:i + 1],
                              table, thr[i:i + 1])
        assert int(alone[0]) == int(in_batch[i])


def test_kernel_path_makes_no_host_sync() -> None:
    rows = _rows(256, 0.6, 0.99)
    table = _table(DEV)
    gumbel_argmax(*rows[:4], table, rows[4])  # compile first: compilation may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = gumbel_argmax(*rows[:4], table, rows[4])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.shape == (256,) and out.device.type == "cuda"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 3, 64, 256])
def test_argmax_rows_is_torch_argmax(batch: int, dtype: torch.dtype) -> None:
    logits = _rows(batch, 0.0, None, dtype)[0]
    logits[0, [7, VOCAB - 1]] = 1e4  # a tie between the first and the last chunk
    assert torch.equal(argmax_rows(logits), logits.argmax(-1))
    assert int(argmax_rows(logits)[0]) == 7
