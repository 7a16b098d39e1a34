"""The fused sampling kernel picks exactly the token of the torch path (Triton interpreter, tiny shapes)."""
from __future__ import annotations

import pytest
import torch

from peregrine.engine.request import Request
from peregrine.kernels.sampling import argmax_rows, gumbel_argmax
from peregrine.sample import Sampler, build_sampling_metadata
from peregrine.sample.noise import as_int32_bits, log_exponentials, row_keys, token_hashes
from peregrine.sampling_params import SamplingParams

NEG_INF = float("-inf")
# Launch shapes: default (one chunk per row here), several chunks, many tiny chunks.
SHAPES = [dict(), dict(block=64, num_chunks=3), dict(block=16, num_chunks=64)]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _inputs(batch: int, vocab: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Random logits (B, V), temperatures, 64-bit seeds (any sign) and steps."""
    g = _gen(seed)
    logits = torch.randn(batch, vocab, generator=g) * 3  # (B, V)
    temp = torch.rand(batch, generator=g) * 1.5 + 0.05  # (B,)
    seeds = torch.randint(-2**63, 2**63 - 1, (batch,), generator=g)  # (B,)
    steps = torch.randint(0, 2**40, (batch,), generator=g)  # (B,)
    return logits, temp, seeds, steps


def _torch_draw(logits: torch.Tensor, temp: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
                thr: torch.Tensor | None = None) -> torch.Tensor:
    """The pure-torch formula (as in Sampler._sample); rows with temperature 0 take the plain argmax."""
    x = logits.float()  # (B, V)
    greedy = temp == 0
    xt = x / torch.where(greedy, 1.0, temp).unsqueeze(-1)  # (B, V)
    keys = row_keys(seeds, steps).unsqueeze(-1)  # (B, 1)
    scores = xt - log_exponentials(keys, token_hashes(torch.arange(x.shape[-1])).unsqueeze(0))  # (B, V)
    if thr is not None:
        scores.masked_fill_(xt < thr.unsqueeze(-1), NEG_INF)
    return torch.where(greedy, x.argmax(-1), scores.argmax(-1))


def _kernel_draw(logits: torch.Tensor, temp: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
                 thr: torch.Tensor | None = None, **shape) -> torch.Tensor:
    table = as_int32_bits(token_hashes(torch.arange(logits.shape[-1])))  # (V,)
    return gumbel_argmax(logits, temp, seeds, steps, table, thr, **shape)


@pytest.mark.parametrize("shape", SHAPES)
def test_same_token_as_torch_for_random_rows(shape: dict) -> None:
    for trial in range(4):
        args = _inputs(3, 300, seed=trial)
        assert torch.equal(_kernel_draw(*args, **shape), _torch_draw(*args))


def test_noise_decides_under_flat_logits() -> None:
    # Flat logits: the token is the argmin of the noise alone, so any hash or log difference shows.
    logits = torch.zeros(6, 2000)
    seeds = torch.tensor([0, 1, -1, 2**63 - 1, -(2**63), 12345])
    steps = torch.tensor([0, 0, 7, 2**33 + 5, 1, 999])
    temp = torch.ones(6)
    out = _kernel_draw(logits, temp, seeds, steps, block=256)
    assert torch.equal(out, _torch_draw(logits, temp, seeds, steps))
    assert len(set(out.tolist())) == 6


@pytest.mark.parametrize("shape", SHAPES[:2])
def test_threshold_keeps_only_tokens_at_or_above_it(shape: dict) -> None:
    logits, temp, seeds, steps = _inputs(4, 300, seed=10)
    xt = logits / temp.unsqueeze(-1)  # (B, V)
    # Row 0 keeps all, row 1 its top 5, row 2 exactly its max, row 3 everything above the median.
    thr = torch.stack([torch.tensor(NEG_INF), xt[1].topk(5).values[-1], xt[2].max(), xt[3].median()])
    out = _kernel_draw(logits, temp, seeds, steps, thr, **shape)
    assert torch.equal(out, _torch_draw(logits, temp, seeds, steps, thr))
    assert int(out[2]) == int(xt[2].argmax())
    assert bool((xt[torch.arange(4), out] >= thr).all())


def test_threshold_equal_to_the_row_max_keeps_exactly_the_max() -> None:
    # Catches any temperature division that is not exactly rounded (x * (1 / T), approximate division):
    # one ulp below the threshold and the only kept token is lost.
    logits, temp, seeds, steps = _inputs(48, 64, seed=12)
    xt = logits / temp.unsqueeze(-1)  # (B, V)
    out = _kernel_draw(logits, temp, seeds, steps, xt.amax(-1))
    assert torch.equal(out, xt.argmax(-1))


def test_greedy_rows_take_argmax_and_ignore_threshold() -> None:
    logits, temp, seeds, steps = _inputs(3, 300, seed=3)
    temp[1] = 0.0
    thr = torch.full((3,), 1e9)  # would exclude everything on a sampled row
    thr[0] = thr[2] = NEG_INF
    out = _kernel_draw(logits, temp, seeds, steps, thr)
    assert int(out[1]) == int(logits[1].argmax())
    assert torch.equal(out, _torch_draw(logits, temp, seeds, steps, thr))


@pytest.mark.parametrize("shape", SHAPES)
def test_ties_and_infinities_follow_torch_argmax(shape: dict) -> None:
    logits = torch.full((4, 300), NEG_INF)
    logits[0, [5, 77, 250]] = 2.0  # sampled row with three finite tokens among -inf
    logits[1, [40, 41, 290]] = 1.0  # greedy row with a three-way tie: the lowest index wins
    # row 2 stays all -inf: torch.argmax returns 0
    logits[3, [9, 200]] = float("inf")  # sampled row with two +inf: the first one wins
    temp = torch.tensor([0.7, 0.0, 1.0, 1.0])
    seeds, steps = torch.arange(4), torch.zeros(4, dtype=torch.long)
    out = _kernel_draw(logits, temp, seeds, steps, **shape)
    assert torch.equal(out, _torch_draw(logits, temp, seeds, steps))
    assert int(out[0]) in (5, 77, 250) and out[1:].tolist() == [40, 0, 9]


# argmax_rows' shapes: one chunk, a few, more chunks than one pass over the partials holds
# (the last takes ~20 s on the interpreter: the slow tier's)
ARGMAX_SHAPES = SHAPES + [pytest.param(dict(block=16, num_chunks=700), marks=pytest.mark.slow)]


@pytest.mark.parametrize("shape", ARGMAX_SHAPES)
def test_argmax_rows_is_torch_argmax(shape: dict) -> None:
    many = shape.get("num_chunks") == 700
    for trial in range(3):
        logits = _inputs(4, 11_000 if many else 300, seed=trial)[0]
        if many:  # a tie between chunks 0 and 512, which one lane of the last pass holds
            logits[1, [8200, 5]] = 100.0
        assert torch.equal(argmax_rows(logits, **shape), logits.argmax(-1))
    logits = torch.full((4, 300), NEG_INF)
    logits[0, [40, 41, 290]] = 1.0  # a three-way tie: the lowest index wins
    logits[1, [299, 3]] = 5.0  # a tie across chunks
    # row 2 stays all -inf: torch.argmax returns 0
    logits[3, [9, 200]] = float("inf")
    assert argmax_rows(logits, **shape).tolist() == logits.argmax(-1).tolist() == [40, 3, 0, 9]
    strided = torch.randn(3, 400, generator=_gen(9))
    assert torch.equal(argmax_rows(strided[:, :300], **shape), strided[:, :300].argmax(-1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_argmax_rows_reads_half_precision(dtype: torch.dtype) -> None:
    logits = _inputs(3, 300, seed=4)[0].to(dtype)
    assert torch.equal(argmax_rows(logits, block=64, num_chunks=3), logits.float().argmax(-1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits_match_their_float32_values(dtype: torch.dtype) -> None:
    logits, temp, seeds, steps = _inputs(3, 300, seed=5)
    half = logits.to(dtype)
    out = _kernel_draw(half, temp, seeds, steps, block=128)
    assert torch.equal(out, _torch_draw(half.float(), temp, seeds, steps))


def test_row_alone_gets_the_same_token_as_in_the_batch() -> None:
    logits, temp, seeds, steps = _inputs(5, 300, seed=6)
    batch = _kernel_draw(logits, temp, seeds, steps)
    for i in (0, 3):
        alone = _kernel_draw(logits[i:i + 1], temp[i:i + 1], seeds[i:i + 1], steps[i:i + 1])
        assert int(alone[0]) == int(batch[i])


def test_strided_rows_are_read_in_place() -> None:
    logits, temp, seeds, steps = _inputs(3, 300, seed=8)
    wide = torch.randn(3, 400)
    wide[:, :300] = logits
    out = _kernel_draw(wide[:, :300], temp, seeds, steps)
    assert torch.equal(out, _torch_draw(logits, temp, seeds, steps))


def test_bad_hash_table_is_rejected() -> None:
    logits, temp, seeds, steps = _inputs(2, 300, seed=9)
    with pytest.raises(ValueError, match="token_hash"):
        gumbel_argmax(logits, temp, seeds, steps, token_hashes(torch.arange(300)))  # int64, not int32


# --- the kernel inside the Sampler ------------------------------------------------------------------

_PARAMS = [dict(temperature=0.6), dict(temperature=0.0), dict(top_p=0.9), dict(top_k=20),
           dict(top_k=20, top_p=0.7, temperature=0.6), dict(min_p=0.05, temperature=1.3), dict(top_k=500),
           dict(top_k=300, top_p=0.5, min_p=0.1),
           dict(repetition_penalty=1.2, presence_penalty=0.3, top_p=0.8),
           dict(frequency_penalty=0.5, min_tokens=5, logprobs=2)]


def _requests(batch: int, seed: int, mixed: bool) -> list[Request]:
    reqs = []
    for i in range(batch):
        params = SamplingParams(**_PARAMS[(i if mixed else seed) % len(_PARAMS)])
        req = Request(f"r{i}", [1, 2, 3], params, arrival_time=0.0, eos_token_ids=(2,), max_tokens=100,
                      seed=1000 * seed + i)
        for tok in [4, 5] * (i % 3):
            req.append_output_token(tok)
        reqs.append(req)
    return reqs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sampler_with_kernel_matches_torch_sampler(dtype: torch.dtype) -> None:
    g = _gen(11)
    for trial in range(len(_PARAMS) + 2):
        mixed = trial >= len(_PARAMS)  # first every setting alone, then batches mixing all of them
        reqs = _requests(len(_PARAMS) if mixed else 3, trial, mixed)
        logits = (torch.randn(len(reqs), 500, generator=g) * 3).to(dtype)  # (B, V)
        meta = build_sampling_metadata(reqs, 500, "cpu")
        before = logits.clone()
        fused = Sampler(use_kernel=True)(logits, meta)
        ref = Sampler(use_kernel=False)(logits, meta)
        assert torch.equal(logits, before)
        assert torch.equal(fused.sampled_token_ids, ref.sampled_token_ids), _PARAMS[trial % len(_PARAMS)]
        if ref.logprobs is not None:
            assert torch.equal(fused.logprobs, ref.logprobs)


def test_forcing_the_kernel_on_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    meta = build_sampling_metadata(_requests(1, 0, False), 50, "cpu")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        Sampler(use_kernel=True)(torch.zeros(1, 50), meta)


def test_warm_up_caches_the_kernel_hash_table() -> None:
    sampler = Sampler(use_kernel=True)
    sampler.warm_up(300, "cpu", torch.bfloat16)
    table = sampler._token_hash_cache[(300, torch.device("cpu"), torch.int32)]
    assert torch.equal(table, as_int32_bits(token_hashes(torch.arange(300))))
