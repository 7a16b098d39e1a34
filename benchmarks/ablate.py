"""Run a `peregrine` command in this process with some of a decode step's kernels left out: how
much of the step's time a part holds on the critical path, measured end to end. (A profiler's
kernel table cannot say this once kernels overlap: a dependent launch's duration includes its
wait for the kernel before it.)

    python benchmarks/ablate.py norm,attention -- bench latency --model MODEL.json

Each part is replaced by a stand-in that launches nothing and returns a tensor of the right
shape (its input, or uninitialised memory), so the tokens are meaningless: time only, with dummy
weights. Parts:
  norm        RMSNorm (and its residual add)
  rope_store  q/k norm, RoPE and the K/V store
  attention   paged attention (decode split and merge, or the extend kernel)
  gemv        the 4-bit weight-only GEMV (one row; with the SiLU-and-mul it may compute)
  act         the SiLU-and-mul kernel
  lm_head     the LM head's matmul (zero logits instead)
Leaving everything out that the step's GPU time is made of shows the floor the rest of a step
(the host's work per step, the sampler) sets.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _skip_norm() -> None:
    import peregrine.kernels.rmsnorm as m

    def rms_norm(x, weight, eps, residual=None, residual_out=None):
        if residual is None:
            return x
        return x, (residual if residual_out is None else residual_out)
    m.rms_norm = rms_norm


def _skip_rope_store() -> None:
    import peregrine.kernels.rope_store as m

    def norm_rope_store(q, k, v, *args, q_out=None, **kwargs):
        return q if q_out is None else q_out
    m.norm_rope_store = norm_rope_store


def _skip_attention() -> None:
    from peregrine.layers.attention import Attention

    def forward(self, q, k, v, kv_cache, meta, out=None):
        t = q.shape[0]
        return (q if out is None else out).reshape(t, self.num_heads * self.head_dim)
    Attention.forward = forward


def _skip_gemv() -> None:
    import peregrine.kernels.wna16_gemv as m

    def wna16_gemv(x, w, config=None, variant=None, gated=False):
        return torch.empty((*x.shape[:-1], w.out_features), dtype=x.dtype, device=x.device)
    m.wna16_gemv = wna16_gemv


def _skip_act() -> None:
    import peregrine.kernels.activation as m

    def silu_and_mul(x, *args, **kwargs):
        return x[..., : x.shape[-1] // 2]
    m.silu_and_mul = silu_and_mul


def _skip_lm_head() -> None:
    from peregrine.layers.embedding import ParallelLMHead

    def compute_logits(self, hidden, out=None):
        if out is None:
            return torch.zeros((hidden.shape[0], self.vocab_size), dtype=torch.float32,
                               device=hidden.device)
        return out.zero_()
    ParallelLMHead.compute_logits = compute_logits


PARTS = {"norm": _skip_norm, "rope_store": _skip_rope_store, "attention": _skip_attention,
         "gemv": _skip_gemv, "act": _skip_act, "lm_head": _skip_lm_head}


def main(argv: list[str]) -> int:
    if "--" not in argv or argv.index("--") != 1:
        raise SystemExit(__doc__)
    parts = [p for p in argv[0].split(",") if p and p != "none"]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise SystemExit(f"unknown part(s) {', '.join(unknown)}; parts: {', '.join(PARTS)}")
    for p in parts:
        PARTS[p]()
    print(f"left out: {', '.join(parts) or 'nothing'}", file=sys.stderr)
    from peregrine.entrypoints.cli import main as cli_main
    return cli_main(argv[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
