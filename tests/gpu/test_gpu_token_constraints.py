"""allowed_token_ids and bad_words on CUDA: the same bans as on the CPU at Qwen3's vocabulary, no
host sync across steps while the recent-token windows move on the device, and through LLM (CUDA
graphs, async scheduling) no disallowed token and no completed bad word."""
from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from gpu_cases import DEV
from peregrine import LLM, SamplingParams
from peregrine.sample import Sampler, SamplingRows
from peregrine.testing.checkpoints import tiny_checkpoint

pytestmark = pytest.mark.gpu

VOCAB = 151_936  # Qwen3
BATCH = 256


def _row_params(i: int, gen: torch.Generator) -> SamplingParams:
    """Every fourth row plain, then allowed lists (small and large), bad words, and both."""
    kind = i % 4
    temp = 0.0 if i % 3 == 0 else 0.8
    allowed = bad = None
    if kind in (1, 3):
        size = 5 if i % 8 < 4 else 50_000
        allowed = torch.randperm(VOCAB, generator=gen)[:size].tolist()
    if kind in (2, 3):
        bad = [torch.randint(0, 4, (n,), generator=gen).tolist() for n in (1, 2, 3, 5)]
    if bad is None:
        return SamplingParams(temperature=temp, allowed_token_ids=allowed)
    return SamplingParams(temperature=temp, allowed_token_ids=allowed, bad_words=["w"],
                          _bad_words_token_ids=bad)


def _rows(device: torch.device | str, params: list[SamplingParams],
          outputs: list[list[int]]) -> SamplingRows:
    rows = SamplingRows(len(params), VOCAB, device)
    for i, (p, out) in enumerate(zip(params, outputs)):
        rows.add_row(i, p, i, (), [0], out)
    return rows


def _steps(device: torch.device | str, num_steps: int, check_sync: bool = False
           ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """num_steps steps of one batch: (the masked logits, the tokens) of each step, on the host.

    Tokens 0..3 get a large boost, so bad-word prefixes (made of them) occur all the time."""
    gen = torch.Generator().manual_seed(0)
    params = [_row_params(i, gen) for i in range(BATCH)]
    outputs = [torch.randint(0, 4, (i % 7,), generator=gen).tolist() for i in range(BATCH)]
    rows = _rows(device, params, outputs)
    sampler = Sampler()
    logits = [torch.randn(BATCH, VOCAB, generator=gen) for _ in range(num_steps)]
    for x in logits:
        x[:, :4] += 6.0
    dev_logits = [x.to(device) for x in logits]
    order = np.arange(BATCH)
    steps = np.array([len(o) for o in outputs], np.int64)
    masked, tokens = [], []
    if check_sync:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        for x in dev_logits:
            meta = rows.metadata(order, steps)
            masked.append(Sampler.apply_penalties(x, meta))
            out = sampler(x, meta).sampled_token_ids
            rows.record_sampled(meta, out)
            tokens.append(out)
            steps = steps + 1
    finally:
        if check_sync:
            torch.cuda.set_sync_debug_mode("default")
    return [m.cpu() for m in masked], [t.cpu() for t in tokens]


def test_bans_equal_the_cpu_bans_over_steps() -> None:
    """The masked logits match exactly step after step when both devices are fed the same tokens
    (the GPU's own draws, replayed on the CPU)."""
    gpu_masked, gpu_tokens = _steps(DEV, 6)
    gen = torch.Generator().manual_seed(0)
    params = [_row_params(i, gen) for i in range(BATCH)]
    outputs = [torch.randint(0, 4, (i % 7,), generator=gen).tolist() for i in range(BATCH)]
    rows = _rows("cpu", params, outputs)
    steps = np.array([len(o) for o in outputs], np.int64)
    banned_total = 0
    for masked, tokens in zip(gpu_masked, gpu_tokens):
        meta = rows.metadata(np.arange(BATCH), steps)
        # Only where the masks fall matters: compare which entries are -inf.
        cpu = Sampler.apply_penalties(torch.zeros(BATCH, VOCAB), meta)
        assert torch.equal(torch.isinf(cpu), torch.isinf(masked))
        banned_total += int(torch.isinf(cpu[2::4]).sum())
        rows.record_sampled(meta, tokens)
        steps = steps + 1
    # NOTE: each of these rows has one one-token word; matched prefixes ban more tokens.
    assert banned_total > (BATCH // 4) * len(gpu_masked)


def test_every_draw_respects_the_constraints() -> None:
    _, tokens = _steps(DEV, 8)
    gen = torch.Generator().manual_seed(0)
    params = [_row_params(i, gen) for i in range(BATCH)]
    outputs = [torch.randint(0, 4, (i % 7,), generator=gen).tolist() for i in range(BATCH)]
    drawn = torch.stack(tokens, dim=1).tolist()  # (B, steps)
    for p, before, new in zip(params, outputs, drawn):
        if p.allowed_token_ids is not None:
            assert set(new) <= set(p.allowed_token_ids)
        full = before + new
        for seq in p._bad_words_token_ids or []:
            ends = [i + len(seq) for i in range(len(full) - len(seq) + 1) if full[i:i + len(seq)] == seq]
            assert all(e <= len(before) for e in ends), (seq, full)


def test_steps_with_constraints_make_no_host_sync() -> None:
    _steps(DEV, 2)  # warm up: compilation and the caching allocator's first blocks may sync
    masked, _ = _steps(DEV, 4, check_sync=True)
    assert len(masked) == 4


def _llm(**kw) -> LLM:
    # NOTE: a fixed KV pool: engines built one after another never depend on freed memory.
    return LLM(tiny_checkpoint("llama"), dtype="float32", max_model_len=128,
               num_gpu_blocks_override=256, **kw)


def test_engine_constrained_tokens_with_graphs_and_async_scheduling() -> None:
    prompts = ["the quick brown fox", "hello world and all", "one two three four five"]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    results = []
    for kw in ({}, {"async_scheduling": False}, {"enforce_eager": True}):
        llm = _llm(**kw)
        tok = llm.get_tokenizer()
        plain = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        word = tok.decode(plain[0][4:6]).strip()
        p = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, bad_words=[word],
                           allowed_token_ids=sorted(set(plain[0]) | set(range(100, 300))))
        seeded = SamplingParams(temperature=1.0, seed=1, max_tokens=24, ignore_eos=True,
                                bad_words=[word], allowed_token_ids=list(range(50, 120)))
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, [p, seeded, p], use_tqdm=False)]
        seqs = p.with_bad_word_tokens(lambda w: tok.encode(w, add_special_tokens=False))
        for o, q in zip(outs, (p, seeded, p)):
            assert set(o) <= set(q.allowed_token_ids)
            for s in seqs._bad_words_token_ids:
                assert all(o[i:i + len(s)] != s for i in range(len(o) - len(s) + 1))
        results.append(outs)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert results[0] == results[1] == results[2]
