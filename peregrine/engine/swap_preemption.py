"""Preemption by swap: whether a preempted request's KV blocks go to the CPU swap space or it is
recomputed (preemption_mode; kv_cache/swap_cost.py weighs the two for auto), and copying a
swapped request's blocks back when it resumes."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from peregrine.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from peregrine.config import SchedulerConfig
    from peregrine.kv_cache.manager import KVCacheManager

logger = logging.getLogger("peregrine")


class SwapPreemption:
    """The scheduler's swap decisions and counters; block copies go into the step's copy lists."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.num_swapped_out = 0  # preemptions that swapped the request's blocks out
        self.num_swapped_in = 0  # swapped requests resumed
        self._warned_full = False

    def swap_out(self, req: Request, copies_out: list[tuple[int, int]]) -> bool:
        """Preempt req by swap when the mode (and, for auto, the costs) says so, adding its
        (device, CPU) block copies to `copies_out`; False: recompute it instead."""
        mode = self.config.preemption_mode
        if mode == "recompute" or self.kv.cpu_pool.num_blocks == 0:
            return False
        # NOTE: the KV kept is that of every known token but the last: like a prefix hit, the
        # resumed request computes at least one token, so its logits exist. A token sampled by a
        # step still in flight is dropped and drawn again on resume (same seed and index). Its
        # KV, and that of the last known token, may still be being written by that step: the
        # workers queue the copy after it (one stream on CUDA; steps run in order on the CPU).
        num_kept = min(req.num_computed_tokens, req.num_tokens - 1)
        if num_kept <= 0:
            return False
        num_copied, num_shared = self.kv.swap_out_size(req, num_kept)
        if mode == "auto":
            cost = self.config.swap_cost
            if cost is None or not cost.prefers_swap(num_kept, num_copied, num_shared):
                return False
        copies = self.kv.swap_out(req, num_kept)
        if copies is None:
            if mode == "swap" and not self._warned_full:
                self._warned_full = True
                logger.warning("the CPU swap space (%d blocks) is full: preempted requests are "
                               "recomputed until it frees up; raise swap_space to swap more",
                               self.kv.cpu_pool.num_blocks)
            return False
        copies_out.extend(copies)
        req.num_computed_tokens = num_kept
        req.num_output_placeholders = 0
        req.status = RequestStatus.SWAPPED
        self.num_swapped_out += 1
        return True

    def release_holds(self, req: Request, waiting: list[Request]) -> bool:
        """Turn the latest swapped request in `waiting` (not req) that holds device blocks into a
        recompute; False when none does.

        NOTE: swapped requests keep the full blocks they share on the device. When nothing else
        runs (so nothing will free a block), those blocks must go before a lone request is
        declared too big for the pool; once no swapped request holds any, req fits if it ever can.
        """
        for other in reversed(waiting):
            if other is not req and self.kv.swapped_device_blocks(other):
                self.kv.free(other)
                other.num_computed_tokens = 0
                other.status = RequestStatus.PREEMPTED
                return True
        return False

    def swap_in(self, req: Request, budget: int, copies_in: list[tuple[int, int]],
                waiting: list[Request], any_running: bool) -> int:
        """Copy a swapped request's blocks back (the copies go into `copies_in`); its tokens to
        compute this step, or 0 (it waits)."""
        num_new = min(req.num_tokens, self.config.max_model_len) - req.num_computed_tokens
        if num_new > budget:
            if not self.config.enable_chunked_prefill:
                return 0
            num_new = budget
        copies = self.kv.swap_in(req, num_new)
        while copies is None and not any_running and self.release_holds(req, waiting):
            copies = self.kv.swap_in(req, num_new)
        if copies is None:
            return 0
        copies_in.extend(copies)
        req.status = RequestStatus.RUNNING
        self.num_swapped_in += 1
        return num_new
