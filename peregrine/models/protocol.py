"""What the engine relies on in a model: the contract CUDA graphs (worker/cuda_graphs.py), the
piecewise graphs, memory profiling and the model runner call. Any registered architecture
satisfies `CausalLM`; models/decoder.py is the shared implementation most families reuse.

How it is built: `cls(hf_config, BuildOptions)` on the target device (models/registry.py).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from peregrine.attention.metadata import AttentionMetadata
from peregrine.layers.kernel_config import KernelConfig

if TYPE_CHECKING:
    from peregrine.attention.backend import AttentionBackend
    from peregrine.layers.quantization import QuantizationConfig

KVCache = tuple[torch.Tensor, torch.Tensor]  # (k_cache, v_cache), each (blocks, block_size, Hkv, D)


@dataclass(frozen=True)
class PipelineStage:
    """The decoder layers [start_layer, end_layer) one pipeline stage builds; the first stage
    also holds the embedding, the last the final norm and the LM head."""

    start_layer: int = 0
    end_layer: int | None = None  # None: through the model's last layer
    is_first: bool = True
    is_last: bool = True

    @classmethod
    def of(cls, partition: Sequence[int], pp_rank: int) -> PipelineStage:
        """Stage `pp_rank` of a partition (layers per stage); one stage: the whole model."""
        if len(partition) <= 1:
            return cls()
        if not 0 <= pp_rank < len(partition):
            raise ValueError(f"pipeline stage {pp_rank} of a {len(partition)}-stage partition")
        start = sum(partition[:pp_rank])
        return cls(start, start + partition[pp_rank], pp_rank == 0,
                   pp_rank == len(partition) - 1)


@dataclass(frozen=True)
class BuildOptions:
    """Everything a model's layers are built with besides config.json."""

    dtype: torch.dtype  # parameters and activations
    backend: AttentionBackend
    quant_config: QuantizationConfig | None = None
    kernels: KernelConfig = field(default_factory=KernelConfig)
    stage: PipelineStage = field(default_factory=PipelineStage)


@runtime_checkable
class PagedAttention(Protocol):
    """The `Attention` layer of one decoder layer (layers/attention.py)."""

    num_heads: int  # q heads on this rank
    num_kv_heads: int
    head_dim: int

    def __call__(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                 kv_cache: KVCache, meta: AttentionMetadata,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """(T, Hq * D) attention; k = v = None when store() already wrote the step's K/V."""

    def store(self, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
              slot_mapping: torch.Tensor) -> None:
        """Write k, v (T, Hkv, D) into the cache at slot_mapping (T,); -1 writes nothing."""


@runtime_checkable
class SelfAttention(Protocol):
    num_heads: int
    num_kv_heads: int
    head_dim: int
    attn: PagedAttention


@runtime_checkable
class PiecewiseLayer(Protocol):
    """A layer split at attention: piecewise graphs capture each half, attention runs between."""

    self_attn: SelfAttention

    def pre_attention(self, positions: torch.Tensor, hidden: torch.Tensor | None,
                      residual: torch.Tensor | None, kv_cache: KVCache,
                      slot_mapping: torch.Tensor,
                      out: tuple[torch.Tensor, torch.Tensor] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """(q (T, Hq, D), residual (T, hidden)), with this step's K/V written into kv_cache at
        slot_mapping (T,) (-1 writes nothing), so attention runs with k = v = None; residual is
        None for the first layer (hidden is then the embedding), hidden None where the layer
        before added it into residual already. With `out` = (q, residual) buffers, the results
        are written there (what piecewise graphs read)."""

    def post_attention(self, attn_out: torch.Tensor, residual: torch.Tensor
                       ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(hidden, residual) for the next layer from attention output (T, Hq * D); hidden is
        None where the layer added it into residual itself (final_norm and stage_output take
        that form)."""


@runtime_checkable
class CausalLM(Protocol):
    """embed_tokens → layers (pre_attention, attention, post_attention) → norm → compute_logits.

    forward must equal running those pieces in that order: the piecewise graphs run them one by
    one over fixed buffers, the decode graphs capture forward + compute_logits whole. Nothing in
    them may read host state that changes between steps.
    """

    embed_tokens: torch.nn.Module  # (T,) ids -> (T, hidden); .weight gives device, dtype, hidden
    layers: Sequence[PiecewiseLayer]
    norm: torch.nn.Module  # norm(hidden, residual) -> (normed (T, hidden), residual)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[KVCache], meta: AttentionMetadata,
                 intermediate: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states (T, hidden) of the flat step batch. Under pipeline parallelism
        (`stage`), a stage but the first starts from `intermediate` (2, T, hidden) = (hidden,
        residual) of the stage before, and a stage but the last returns its own."""

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None
                       ) -> torch.Tensor:
        """float32 logits (N, V) over the whole vocabulary from hidden (N, hidden), written
        into out (N, V) float32 when given (a decode graph's shared buffer: no second float32
        copy)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill the parameters from checkpoint tensors named as in Hugging Face checkpoints."""


def stage_output(x: torch.Tensor | None, residual: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """(2, T, hidden) = (hidden, residual) for the next pipeline stage (written into out when
    given); a hidden already added into residual (x None) goes as zeros."""
    if out is None:
        return torch.stack((torch.zeros_like(residual) if x is None else x, residual))
    if x is None:
        out[0].zero_()
    else:
        out[0].copy_(x)
    out[1].copy_(residual)
    return out


def final_norm(norm: torch.nn.Module, x: torch.Tensor | None, residual: torch.Tensor | None
               ) -> torch.Tensor:
    """The last layer's output through the final norm: norm(x + residual), or norm(residual)
    where x was added into it already (None), or norm(x) with no residual (no layers)."""
    if x is None:
        return norm(residual)
    if residual is None:
        return norm(x)
    return norm(x, residual)[0]
