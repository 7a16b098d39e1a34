"""Which kernels the layers are built with: decided once, before the model is built."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from peregrine import envs


@dataclass(frozen=True)
class KernelConfig:
    """Layer implementation choices, fixed at construction (no flags flipped afterwards)."""

    fused: bool = False  # Triton RMSNorm, RoPE and SiLU-and-mul instead of torch ops

    @classmethod
    def for_device(cls, device: torch.device | str) -> KernelConfig:
        """Fused kernels on CUDA, where they measured faster, unless PEREGRINE_FUSED_KERNELS=0."""
        return cls(fused=torch.device(device).type == "cuda" and envs.fused_kernels())
