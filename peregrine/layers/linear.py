"""Linear layers split for tensor parallelism (column- and row-parallel); world size 1 works as is.

Each layer's parameters, checkpoint loading and matmul come from its `QuantMethod`
(layers/quantization/): unquantized unless the model's quantization config says otherwise.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from peregrine.distributed import divide, tp_all_reduce, tp_rank, tp_size
from peregrine.layers.norm import RMSNorm
from peregrine.layers.quantization import (QuantizationConfig, UnquantizedLinearMethod,
                                           linear_param, load_sharded)


class LinearBase(nn.Module):
    """y = x W^T (+ b) over this rank's shard of W, through the layer's quant method.

    prefix: the layer's checkpoint module name (e.g. "model.layers.0.mlp.down_proj"); a merged
    layer is loaded from the sibling modules in shard_names (e.g. q_proj, k_proj, v_proj).
    """

    shards_output = True  # column-parallel: outputs split over ranks; row-parallel: inputs

    def __init__(self, in_features: int, out_sizes: Sequence[int], bias: bool, *,
                 dtype: torch.dtype, quant_config: QuantizationConfig | None = None,
                 prefix: str = "", shard_names: Sequence[str] = ()) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.out_sizes = list(out_sizes)  # every merged projection's size over all ranks
        self.shard_names = tuple(shard_names)
        parent = prefix.rpartition(".")[0]
        self.prefixes = ([f"{parent}.{s}".lstrip(".") for s in self.shard_names]
                         if self.shard_names else [prefix])
        method = quant_config.get_quant_method(self.prefixes) if quant_config else None
        self.quant_method = method or UnquantizedLinearMethod()
        if self.shards_output:
            in_per_rank = in_features
            out_per_rank = [divide(s, self.tp_size, "output size") for s in self.out_sizes]
        else:
            in_per_rank = divide(in_features, self.tp_size, "input size")
            out_per_rank = list(self.out_sizes)
        self.quant_method.create_weights(self, in_per_rank, out_per_rank, dtype)
        self.bias = None
        if bias:
            # NOTE: a row-parallel bias is whole on every rank (added once, after the reduction).
            self.bias = linear_param((sum(out_per_rank),), dtype,
                                     output_dim=0 if self.shards_output else None, input_dim=None)

    @property
    def is_equal_pair(self) -> bool:
        """Two merged column-parallel projections of one size (a gated MLP's gate and up): this
        rank's rows are its slice of the first, then its slice of the second."""
        return (self.shards_output and len(self.out_sizes) == 2
                and self.out_sizes[0] == self.out_sizes[1])

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int | None,
                      name: str) -> None:
        """Load checkpoint tensor `name` (merged projection `shard`, or None) into `param`."""
        if param is self.bias:
            load_sharded(self, param, loaded, shard, name)
        else:
            self.quant_method.load_weight(self, param, loaded, shard, name)


class ColumnParallelLinear(LinearBase):
    """y = x W^T with W split along the output dim; each rank keeps its slice of y."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, **kw) -> None:
        super().__init__(in_features, [out_features], bias, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)  # (T, out_per_rank)

    def forward_normed(self, h: torch.Tensor, norm: nn.Module) -> torch.Tensor | None:
        """forward(norm(h)) for rows h (T, in) of the residual stream, the RMSNorm inside the
        weight's kernel; None where the quantization method has no such kernel for h, or the
        norm is not the plain RMSNorm on the fused kernels."""
        if not (isinstance(norm, RMSNorm) and norm.use_fused):
            return None
        return self.quant_method.apply_rms_normed(self, h, norm.weight, norm.eps, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one GEMM (e.g. gate+up)."""

    def __init__(self, in_features: int, out_sizes: Sequence[int], bias: bool = False,
                 **kw) -> None:
        LinearBase.__init__(self, in_features, out_sizes, bias, **kw)

    def forward_normed_silu_and_mul(self, h: torch.Tensor, norm: nn.Module
                                    ) -> torch.Tensor | None:
        """silu(g) * u (T, I) of [g, u] = forward(norm(h)) for a gate-and-up pair, the norm and
        the activation inside the weight's kernel; None where the method has no such kernel for
        h, the layer is not an equal pair, has a bias, or the norm is not the fused RMSNorm."""
        if not (self.is_equal_pair and self.bias is None and isinstance(norm, RMSNorm)
                and norm.use_fused):
            return None
        return self.quant_method.apply_rms_normed_silu_and_mul(self, h, norm.weight, norm.eps)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q, k, v projections; each rank holds its q heads and its kv heads."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, **kw) -> None:
        tp = tp_size()
        # NOTE: with more ranks than kv heads, kv heads are replicated (not supported yet).
        if num_kv_heads % tp:
            raise ValueError(f"num_key_value_heads ({num_kv_heads}) must be divisible by the "
                             f"tensor-parallel size ({tp})")
        kw.setdefault("shard_names", ("q_proj", "k_proj", "v_proj"))
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        LinearBase.__init__(self, hidden, sizes, bias, **kw)


class RowParallelLinear(LinearBase):
    """y = x W^T with W split along the input dim; partial sums are all-reduced."""

    shards_output = False

    def __init__(self, in_features: int, out_features: int, bias: bool = False, **kw) -> None:
        super().__init__(in_features, [out_features], bias, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._reduce(self.quant_method.apply(self, x))  # (T, out)

    def forward_silu_and_mul(self, h: torch.Tensor) -> torch.Tensor | None:
        """forward(silu(h[:, :I]) * h[:, I:]) for gate-and-up rows h (T, 2I), the activation
        computed inside the weight's kernel; None where the quantization method has no such
        kernel for h."""
        y = self.quant_method.apply_silu_and_mul(self, h)
        return None if y is None else self._reduce(y)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor | None:
        """residual + forward(x), the add inside the weight's kernel; None where the method has
        no such kernel for x, or the output is reduced over ranks or takes a bias (the add then
        follows them)."""
        if self.tp_size > 1 or self.bias is not None:
            return None
        return self.quant_method.apply_add(self, x, residual)

    def forward_silu_and_mul_add(self, h: torch.Tensor,
                                 residual: torch.Tensor) -> torch.Tensor | None:
        """residual + forward_silu_and_mul(h), all inside the weight's kernel; None as for
        forward_add."""
        if self.tp_size > 1 or self.bias is not None:
            return None
        return self.quant_method.apply_silu_and_mul_add(self, h, residual)

    def _reduce(self, y: torch.Tensor) -> torch.Tensor:
        """The layer's output from this rank's partial sums y (T, out): all-reduced, then the
        bias, added once after the reduction, not on every rank."""
        y = tp_all_reduce(y)
        return y + self.bias if self.bias is not None else y
