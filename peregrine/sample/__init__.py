"""Sampling: per-step metadata, the batched sampler, and token logprobs."""
from __future__ import annotations

from peregrine.sample.logprobs import LogprobsTensors, compute_token_logprobs
from peregrine.sample.metadata import SamplingMetadata, SamplingRows, build_sampling_metadata
from peregrine.sample.sampler import Sampler, SamplerOutput

__all__ = [
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "SamplingRows",
    "build_sampling_metadata",
    "compute_token_logprobs",
]
