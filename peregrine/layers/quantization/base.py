"""The quantization interfaces: a `QuantizationConfig` (parsed from config.json) hands each linear
layer a `QuantMethod`, which creates the layer's parameters, loads checkpoint tensors into them
and applies the layer."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

if TYPE_CHECKING:
    from peregrine.layers.linear import LinearBase


def linear_param(shape: tuple[int, ...], dtype: torch.dtype, *, output_dim: int | None,
                 input_dim: int | None, packed_dim: int | None = None,
                 pack_factor: int = 1) -> nn.Parameter:
    """An uninitialised parameter tagged with how checkpoint tensors map onto it.

    output_dim / input_dim: which dim runs along the layer's outputs / inputs (None: the tensor is
    the same on every rank, e.g. a row-parallel bias or a per-tensor scale). packed_dim: the dim
    along which pack_factor logical values share one element (int4 packed 8 per int32), or along
    which one element covers pack_factor inputs (a group-wise scale).
    """
    if pack_factor < 1 or (packed_dim is None) != (pack_factor == 1):
        raise ValueError(f"packed_dim {packed_dim} and pack_factor {pack_factor} must come "
                         "together")
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    param.output_dim = output_dim
    param.input_dim = input_dim
    param.packed_dim = packed_dim
    param.pack_factor = pack_factor
    return param


def _mismatch(name: str, loaded: torch.Tensor, expect: tuple[int, ...]) -> ValueError:
    return ValueError(f"tensor {name!r}: checkpoint shape {tuple(loaded.shape)} does not match "
                      f"the model's {expect}")


def load_sharded(layer: LinearBase, param: nn.Parameter, loaded: torch.Tensor, shard: int | None,
                 name: str) -> None:
    """Copy this rank's part of checkpoint tensor `loaded` into `param`.

    Column-parallel layers split along the param's output_dim, each merged projection (`shard`,
    e.g. 0/1/2 for q/k/v) separately; row-parallel layers split along its input_dim. Packed
    dims count elements, not logical values.
    """
    dim = param.output_dim if layer.shards_output else param.input_dim
    merged = len(layer.out_sizes) > 1
    if merged and shard is None and param.output_dim is not None:
        raise ValueError(f"checkpoint tensor {name!r} must be split into its projections")
    if dim is None:  # the same tensor on every rank
        if tuple(loaded.shape) != tuple(param.shape):
            raise _mismatch(name, loaded, tuple(param.shape))
        param.data.copy_(loaded)
        return
    tp, rank = layer.tp_size, layer.tp_rank
    if layer.shards_output:
        factor = param.pack_factor if param.packed_dim == dim else 1
        sizes = []
        for full in layer.out_sizes:
            if (full // tp) % factor:
                raise ValueError(f"tensor {name!r}: {full // tp} outputs per rank do not pack "
                                 f"{factor} to an element")
            sizes.append(full // tp // factor)
        shard = shard or 0
        start, per_rank = sum(sizes[:shard]), sizes[shard]
    else:
        start, per_rank = 0, param.shape[dim]
    expect = list(param.shape)
    expect[dim] = per_rank * tp
    if tuple(loaded.shape) != tuple(expect):
        raise _mismatch(name, loaded, tuple(expect))
    param.data.narrow(dim, start, per_rank).copy_(loaded.narrow(dim, rank * per_rank, per_rank))


class QuantMethod(ABC):
    """How one linear layer holds, loads and applies its weight."""

    # Whether apply's small-batch kernels are launched as programmatic dependents that wait for
    # the kernel ahead inside themselves (this project's GEMVs), not plainly (cuBLAS): the kernels
    # before them may then let them be scheduled early (kernels/_utils.release_rope_store).
    dependent_launches = False

    @abstractmethod
    def create_weights(self, layer: LinearBase, in_features: int, out_sizes: list[int],
                       dtype: torch.dtype) -> None:
        """Register the layer's weight parameters for this rank: in_features inputs, outputs in
        out_sizes (one entry per merged projection); dtype is the model's activation dtype."""

    def load_weight(self, layer: LinearBase, param: nn.Parameter, loaded: torch.Tensor,
                    shard: int | None, name: str) -> None:
        """Load checkpoint tensor `name` (projection `shard` of a merged layer) into `param`."""
        load_sharded(layer, param, loaded, shard, name)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        """Repack or convert the loaded parameters (once, before the first forward)."""

    @abstractmethod
    def apply(self, layer: LinearBase, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        """y (T, out_per_rank) of x (T, in_per_rank), plus bias when given."""

    def apply_silu_and_mul(self, layer: LinearBase, h: torch.Tensor,
                           bias: torch.Tensor | None = None) -> torch.Tensor | None:
        """y of x = silu(h[:, :I]) * h[:, I:] for gate-and-up rows h (T, 2 in_per_rank), with
        the activation inside this method's own kernel; None where it has no such kernel for h
        (the caller then runs the activation kernel and apply)."""
        return None

    # NOTE: the three hooks below let a method's small-batch kernels take the RMSNorm between two
    # layers' linears: the row-parallel linear before the norm adds the residual in its epilogue
    # (the residual stream comes out of its kernel), and the column-parallel one after it reads
    # that stream and normalises it as it reads. None from any of them: the caller runs the
    # norm kernel and apply, with the same result up to the norm's rounding.

    def apply_add(self, layer: LinearBase, x: torch.Tensor,
                  residual: torch.Tensor) -> torch.Tensor | None:
        """residual + y of x (T, in_per_rank), residual (T, out) in x's dtype, the add inside
        this method's kernel, rounded as the norm kernel's residual add is (only called where
        this rank's y is the whole output: one tensor-parallel rank, no bias); None where it
        has no such kernel for x."""
        return None

    def apply_silu_and_mul_add(self, layer: LinearBase, h: torch.Tensor,
                               residual: torch.Tensor) -> torch.Tensor | None:
        """apply_add of x = silu(h[:, :I]) * h[:, I:] (apply_silu_and_mul's input), both inside
        one kernel; None where it has none."""
        return None

    def apply_rms_normed(self, layer: LinearBase, h: torch.Tensor, norm_weight: torch.Tensor,
                         eps: float, bias: torch.Tensor | None = None) -> torch.Tensor | None:
        """y of x = h / rms(h) * norm_weight for rows h (T, in_per_rank) of the residual stream
        (an RMSNorm whose weight multiplies the normalised row), the norm inside this method's
        kernel, in float32 and not rounded to h's dtype before the product (the norm kernel
        rounds it: results differ by that rounding); None where it has no such kernel for h."""
        return None

    def apply_rms_normed_silu_and_mul(self, layer: LinearBase, h: torch.Tensor,
                                      norm_weight: torch.Tensor,
                                      eps: float) -> torch.Tensor | None:
        """silu(y[:, :I]) * y[:, I:] (T, I) of y = apply_rms_normed(h) for a merged gate-and-up
        layer (gate rows, then up rows; no bias), the activation in the same kernel, each value
        rounded as apply_rms_normed's output and then the activation kernel round them; None
        where it has no such kernel for h."""
        return None


class QuantizationConfig(ABC):
    """A checkpoint's quantization settings (config.json `quantization_config`)."""

    name: ClassVar[str]  # the `quant_method` value it is registered under
    # Checkpoint module names left unquantized: a full name, a suffix ("lm_head", "mlp.down_proj")
    # or a prefix ("model.layers.0").
    skip_modules: tuple[str, ...] = ()

    @classmethod
    @abstractmethod
    def from_config(cls, cfg: dict[str, Any]) -> QuantizationConfig:
        """Parse `quantization_config` ({} when only --quantization names the method)."""

    @abstractmethod
    def linear_method(self, prefixes: list[str]) -> QuantMethod:
        """The method of a linear layer loaded from these checkpoint modules."""

    def is_skipped(self, prefix: str) -> bool:
        return any(prefix == s or prefix.endswith("." + s) or prefix.startswith(s + ".")
                   for s in self.skip_modules)

    def get_quant_method(self, prefixes: list[str]) -> QuantMethod | None:
        """The layer's method, or None (unquantized) when its modules are skipped. A fused layer
        (q/k/v, gate/up) is skipped as a whole or not at all."""
        skipped = [self.is_skipped(p) for p in prefixes]
        if skipped and all(skipped):
            return None
        if any(skipped):
            raise ValueError(f"{self.name}: the fused modules {prefixes} are only partly skipped "
                             "(quantize all of them or none)")
        return self.linear_method(prefixes)
