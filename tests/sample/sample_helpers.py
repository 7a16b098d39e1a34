"""Helpers for sampler tests: Requests with given params, sampled on the CPU (imported, not a conftest)."""
from __future__ import annotations

import torch

from peregrine.engine.request import Request
from peregrine.sample import Sampler, SamplerOutput, build_sampling_metadata
from peregrine.sampling_params import SamplingParams


def make_request(seed: int = 0, prompt: list[int] | None = None, output: list[int] | None = None,
                 eos: tuple[int, ...] = (), **params) -> Request:
    """A Request with `params` as SamplingParams, a fixed seed and `output` already generated."""
    req = Request(f"r{seed}", list(prompt or [0]), SamplingParams(**params), arrival_time=0.0,
                  eos_token_ids=eos, max_tokens=1000, seed=seed)
    for tok in output or []:
        req.append_output_token(tok)
    return req


def sample(logits: torch.Tensor, requests: list[Request], sampler: Sampler | None = None) -> SamplerOutput:
    """Build metadata for `requests` and sample `logits` (row b = requests[b])."""
    meta = build_sampling_metadata(requests, logits.shape[-1], logits.device)
    return (sampler or Sampler())(logits, meta)


def rng(seed: int = 1234) -> torch.Generator:
    """A CPU generator for test inputs (the sampler itself never uses torch's RNG)."""
    return torch.Generator().manual_seed(seed)
