"""The target's own weights, quantized online, as the draft: with dummy weights the draft holds
the target's tensors (within the quantization's error) and its logits follow the target's."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from peregrine.attention import get_attention_backend
from peregrine.config import EngineArgs
from peregrine.layers.linear import LinearBase
from peregrine.layers.quantization.fp8 import Fp8OnlineMethod
from peregrine.layers.quantization.rtn import RTNLinearMethod
from peregrine.spec_decode.draft_model import DraftModelProposer
from peregrine.testing.checkpoints import tiny_checkpoint
from peregrine.testing.steps import one_prefill
from peregrine.worker.loader import load_model

CPU = torch.device("cpu")
# Relative (Frobenius) error bound of a dequantized weight: 4-bit round-to-nearest with one
# scale per output channel of 64-128 Gaussian inputs errs ~0.1; 8-bit ~0.006; FP8 e4m3 ~0.03.
QUANT = {"rtn": (RTNLinearMethod, 0.15), "rtn-int8": (RTNLinearMethod, 0.01),
         "fp8": (Fp8OnlineMethod, 0.04)}


def self_draft(quant: str, seed: int = 0):
    """(target model, proposer) for the dummy-weight llama and its own quantized weights."""
    path = str(tiny_checkpoint("llama"))
    cfg = EngineArgs(model=path, dtype="float32", device="cpu", load_format="dummy", seed=seed,
                     max_model_len=128, block_size=16, num_gpu_blocks_override=8,
                     speculative_config={"model": path, "quantization": quant,
                                         "num_speculative_tokens": 2}).create_engine_config()
    target = load_model(cfg.model, get_attention_backend("torch"), CPU)
    proposer = DraftModelProposer(cfg, cfg.speculative, CPU)
    proposer.load_model(target)
    return target, proposer


@pytest.mark.parametrize("quant", sorted(QUANT))
def test_self_draft_holds_the_targets_dummy_weights_quantized(quant):
    method, bound = QUANT[quant]
    target, proposer = self_draft(quant)
    ours = dict(target.named_modules())
    linears = [(n, m) for n, m in proposer.model.named_modules() if isinstance(m, LinearBase)]
    assert linears and all(isinstance(m.quant_method, method) for _, m in linears)
    with torch.inference_mode():
        for name, layer in linears:
            want = ours[name].weight  # (N, K)
            got = layer.quant_method.apply(layer, torch.eye(want.shape[1])).t()  # (N, K)
            assert (got - want).norm() / want.norm() < bound, name
    # Embeddings, norms and the LM head are not quantized: the very same values.
    params = dict(target.named_parameters())
    for name, p in proposer.model.named_parameters():
        if not any(name.startswith(n + ".") for n, _ in linears):
            assert torch.equal(p, params[name]), name


def _logits(model, cfg, ids: torch.Tensor) -> torch.Tensor:
    kv, meta = one_prefill(cfg, ids.numel(), num_blocks=4, block_size=16)
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.arange(ids.numel()), kv, meta))  # (T, V)


def _centered_cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.cosine_similarity(a - a.mean(-1, keepdim=True), b - b.mean(-1, keepdim=True), dim=-1)


@pytest.mark.parametrize("quant", sorted(QUANT))
def test_self_draft_logits_follow_the_targets(quant):
    target, proposer = self_draft(quant)
    ids = torch.randint(5, 500, (64,), generator=torch.Generator().manual_seed(0))  # (T,)
    want = _logits(target, proposer.engine_config.model, ids)  # (T, V)
    got = _logits(proposer.model, proposer.draft_config, ids)  # (T, V)
    # NOTE: the contrast: another seed's dummy model shares no argmax and no logit direction.
    other, _ = self_draft(quant, seed=1)
    unrelated = _logits(other, proposer.engine_config.model, ids)
    assert _centered_cosine(got, want).min() > 0.95
    assert _centered_cosine(unrelated, want).max() < 0.3
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8
    assert (unrelated.argmax(-1) == want.argmax(-1)).float().mean() < 0.1
