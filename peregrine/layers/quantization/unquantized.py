"""The unquantized method: a plain (out, in) weight in the model dtype, applied with F.linear."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from peregrine.layers.quantization.base import QuantMethod, linear_param

if TYPE_CHECKING:
    from peregrine.layers.linear import LinearBase


class UnquantizedLinearMethod(QuantMethod):
    """weight (out_per_rank, in_per_rank), loaded by the generic sharded loader."""

    def create_weights(self, layer: LinearBase, in_features: int, out_sizes: list[int],
                       dtype: torch.dtype) -> None:
        layer.weight = linear_param((sum(out_sizes), in_features), dtype, output_dim=0, input_dim=1)

    def apply(self, layer: LinearBase, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)
