"""When swapping a preempted request's KV to CPU memory beats recomputing it (preemption "auto").

The rule compares two costs in seconds:

  swap      = 2 x (SWAP_FIXED_S + 2 x num_layers x COPY_LAUNCH_S + copied_bytes / copy_bandwidth)
              out and back in, each a fixed setup cost, one gather/scatter launch per K and V
              tensor of every layer, and the bytes over PCIe (or memcpy on a CPU device);
  recompute = (2 x params_per_layer_stack x tokens + attention FLOPs) / flops_per_s
              the prefill of every token whose KV would be dropped, attention included:
              4 x num_layers x num_heads x head_dim FLOPs per (query, key) pair, and a causal
              prefill from position c0 to c1 has (c1^2 - c0^2) / 2 pairs. Tokens held in blocks that
              stay on the device (shared prefix blocks) are not recomputed.

Both grow with the sequence, but the swap starts from a fixed cost while recompute starts at zero:
short sequences are recomputed, long ones swapped. With the CUDA constants below and Llama-3-8B
(bf16 KV, 128 KiB per token; 14 GFLOP per token) the crossover is about 60 tokens.

The constants are rough and meant to be re-measured on the machine at hand:
`python benchmarks/swap_bench.py --measure` prints the copy bandwidth and prefill FLOP/s it sees,
and DeviceCosts(...) with those numbers can be passed to SwapCostModel.for_model.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceCosts:
    """What copying and computing cost on one kind of device."""

    copy_bandwidth: float  # bytes/s of a device <-> pinned CPU block copy, one direction
    flops_per_s: float  # achieved prefill throughput (dense matmuls), FLOP/s
    fixed_s: float  # per swap direction: index uploads, staging allocation, host work
    copy_launch_s: float  # per gather/scatter launch (two per layer: K and V)


# NOTE: CUDA: measured on an H200 with Llama-3-8B (benchmarks/swap_bench.py --measure): pinned,
# gathered block copies move ~45 GB/s each way, a one-block swap costs ~0.5 ms of fixed work, and
# bf16 prefill reaches ~520 TFLOP/s by the cost model's count; the swap-or-recompute crossover is
# then ~108 tokens in use. CPU: a "swap" is a memcpy (~5 GB/s on a busy host) and fp32 matmuls reach ~50 GFLOP/s on
# a few cores. Re-measure with benchmarks/swap_bench.py --measure.
DEVICE_COSTS: dict[str, DeviceCosts] = {
    "cuda": DeviceCosts(copy_bandwidth=45e9, flops_per_s=520e12, fixed_s=485e-6,
                        copy_launch_s=5e-6),
    "cpu": DeviceCosts(copy_bandwidth=5e9, flops_per_s=50e9, fixed_s=20e-6, copy_launch_s=2e-6),
}


@dataclass(frozen=True)
class SwapCostModel:
    """The model's shape reduced to what the swap-or-recompute rule needs."""

    bytes_per_block: int  # K and V of every layer for one block (attention/kv_dtype.py)
    block_size: int
    num_layers: int
    flops_per_token: float  # 2 x the parameters a token passes through (no embedding, no head)
    attn_flops_per_pair: float  # 4 x num_heads x head_dim x num_layers
    device: DeviceCosts

    @classmethod
    def for_model(cls, *, bytes_per_block: int, block_size: int, num_layers: int, hidden_size: int,
                  intermediate_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                  device: str | DeviceCosts) -> SwapCostModel:
        """Costs of a pre-norm decoder (attention q/k/v/o + gated MLP per layer) on `device`."""
        costs = device if isinstance(device, DeviceCosts) else DEVICE_COSTS[
            "cuda" if device.startswith("cuda") else "cpu"]
        q, kv = num_heads * head_dim, num_kv_heads * head_dim
        params = num_layers * (hidden_size * (2 * q + 2 * kv) + 3 * hidden_size * intermediate_size)
        return cls(bytes_per_block, block_size, num_layers, 2.0 * params,
                   4.0 * num_heads * head_dim * num_layers, costs)

    def swap_seconds(self, num_blocks: int) -> float:
        """Copying `num_blocks` blocks out and back in."""
        d = self.device
        one_way = (d.fixed_s + 4 * self.num_layers * d.copy_launch_s
                   + num_blocks * self.bytes_per_block / d.copy_bandwidth)
        return 2.0 * one_way

    def recompute_seconds(self, num_tokens: int, num_kept_tokens: int = 0) -> float:
        """Prefilling tokens num_kept_tokens..num_tokens again (the first ones stay cached)."""
        n = max(0, num_tokens - num_kept_tokens)
        pairs = (num_tokens * num_tokens - num_kept_tokens * num_kept_tokens) / 2
        return (self.flops_per_token * n + self.attn_flops_per_pair * pairs) / \
            self.device.flops_per_s

    def prefers_swap(self, num_tokens: int, num_copied_blocks: int,
                     num_kept_tokens: int = 0) -> bool:
        """True when copying the blocks out and in is cheaper than recomputing the tokens."""
        if num_copied_blocks <= 0:
            return False
        return (self.swap_seconds(num_copied_blocks)
                < self.recompute_seconds(num_tokens, num_kept_tokens))

    def crossover_tokens(self, limit: int = 1 << 20) -> int:
        """The shortest sequence (nothing shared) that is swapped rather than recomputed."""
        lo, hi = 1, limit
        while lo < hi:
            mid = (lo + hi) // 2
            if self.prefers_swap(mid, -(-mid // self.block_size)):
                hi = mid
            else:
                lo = mid + 1
        return lo
