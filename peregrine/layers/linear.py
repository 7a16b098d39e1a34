"""Linear layers split for tensor parallelism (column- and row-parallel); world size 1 works as is."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from peregrine.distributed import divide, tp_all_reduce, tp_rank, tp_size


class _ShardedLinear(nn.Module):
    """A linear layer holding this rank's shard of the weight: (out_per_rank, in_per_rank)."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    @staticmethod
    def _check(param: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
        if param.shape != loaded.shape:
            raise ValueError(f"tensor {name!r}: checkpoint shape {tuple(loaded.shape)} does not "
                             f"match the model's {tuple(param.shape)}")


class ColumnParallelLinear(_ShardedLinear):
    """y = x W^T with W split along the output dim; each rank keeps its slice of y."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        self.out_sizes = [out_features]
        super().__init__(in_features, divide(out_features, tp_size(), "output size"), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def load_shard(self, param: torch.Tensor, loaded: torch.Tensor, shard: int, name: str) -> None:
        """Copy this rank's slice of output shard `shard` of a checkpoint tensor into `param`."""
        sizes = [s // tp_size() for s in self.out_sizes]
        start = sum(sizes[:shard])
        per_rank = sizes[shard]
        full = self.out_sizes[shard]
        if loaded.shape[0] != full or (param.dim() == 2 and loaded.shape[1] != param.shape[1]):
            expect = (full,) + tuple(param.shape[1:])
            raise ValueError(f"tensor {name!r}: checkpoint shape {tuple(loaded.shape)} does not "
                             f"match the model's {expect}")
        piece = loaded.narrow(0, tp_rank() * per_rank, per_rank)
        param.data.narrow(0, start, per_rank).copy_(piece)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one GEMM (e.g. gate+up)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False) -> None:
        super().__init__(in_features, sum(out_sizes), bias)
        self.out_sizes = list(out_sizes)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q, k, v projections; each rank holds its q heads and its kv heads."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False) -> None:
        tp = tp_size()
        # NOTE: with more ranks than kv heads, kv heads are replicated (not supported yet).
        if num_kv_heads % tp:
            raise ValueError(f"num_key_value_heads ({num_kv_heads}) must be divisible by the "
                             f"tensor-parallel size ({tp})")
        super().__init__(hidden, (num_heads + 2 * num_kv_heads) * head_dim, bias)
        self.out_sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]


class RowParallelLinear(_ShardedLinear):
    """y = x W^T with W split along the input dim; partial sums are all-reduced."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(divide(in_features, tp_size(), "input size"), out_features, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: the bias is added once, after the reduction, not on every rank.
        y = F.linear(x, self.weight)
        y = tp_all_reduce(y)
        return y + self.bias if self.bias is not None else y

    def load_full(self, param: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
        if param is self.bias:
            self._check(param, loaded, name)
            param.data.copy_(loaded)
            return
        per_rank = param.shape[1]
        if loaded.shape != (param.shape[0], per_rank * tp_size()):
            raise ValueError(f"tensor {name!r}: checkpoint shape {tuple(loaded.shape)} does not "
                             f"match the model's {(param.shape[0], per_rank * tp_size())}")
        param.data.copy_(loaded.narrow(1, tp_rank() * per_rank, per_rank))
