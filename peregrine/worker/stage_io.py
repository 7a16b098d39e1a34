"""One worker's pipeline-stage traffic: the previous stage's (hidden, residual) in, this stage's
out, and a timer of how long the stage works per step against how long it waits.

The receiving side knows the tensor's shape from the step itself (its token count, or its padded
count under CUDA graphs, which every stage pads alike), so no size is exchanged. Sends are
asynchronous; a send is waited on before the next one starts, and before a graph rewrites the
fixed buffer it was sent from (wait_sent).
"""
from __future__ import annotations

import time

import torch

from peregrine.distributed import pp_recv, pp_send
from peregrine.models.protocol import PipelineStage

Marker = float | torch.cuda.Event  # a host time (CPU) or a timing event (CUDA)


class StageIO:
    """Send / receive between neighbouring stages, and this stage's busy and idle time."""

    def __init__(self, stage: PipelineStage, hidden_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.stage = stage
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.device = device
        self._sending: tuple[torch.Tensor, object] | None = None  # (tensor, its send's work)
        self._start: Marker | None = None
        self._span_start: Marker | None = None
        self._stats = {"steps": 0, "graph_steps": 0, "busy_s": 0.0, "span_s": 0.0,
                       "recv_wait_s": 0.0}

    def begin_step(self, num_tokens: int, out: torch.Tensor | None = None,
                   graph: bool = False) -> torch.Tensor | None:
        """The previous stage's (2, T, hidden) output for this step of T tokens (None on the
        first stage), received into `out` when given (a graph's fixed input buffer); the step's
        work starts here. graph: the step runs through the CUDA graphs (counted)."""
        self._stats["graph_steps"] += graph
        x = None
        if not self.stage.is_first:
            x = out if out is not None else torch.empty(
                (2, num_tokens, self.hidden_size), dtype=self.dtype,
                device=self.device)  # (2, T, hidden)
            if x.shape != (2, num_tokens, self.hidden_size):
                raise ValueError(f"a stage input of {num_tokens} tokens cannot go into "
                                 f"{tuple(x.shape)}")
            t0 = time.perf_counter()
            pp_recv(x)
            self._stats["recv_wait_s"] += time.perf_counter() - t0
        self._start = self._mark()
        return x

    def send(self, x: torch.Tensor) -> None:
        """Start sending this stage's (2, T, hidden) output to the next stage."""
        self.wait_sent()
        self._sending = (x, pp_send(x))

    def wait_sent(self) -> None:
        """Order what comes next after the last send (on the device's stream, or on the host
        for CPU tensors): call before rewriting the buffer it was sent from."""
        if self._sending is not None:
            self._sending[1].wait()
            self._sending = None

    def end_step(self) -> tuple[Marker, Marker]:
        """The step's work here is queued: its (start, end) markers, for `account` once done."""
        return self._start, self._mark()

    def account(self, timer: tuple[Marker, Marker]) -> None:
        """Add a finished step's work to the stage's busy time."""
        start, end = timer
        if self._span_start is None:
            self._span_start = start
        if isinstance(end, float):
            busy, span = end - start, end - self._span_start
        else:
            end.synchronize()
            busy = start.elapsed_time(end) / 1e3
            span = self._span_start.elapsed_time(end) / 1e3
        s = self._stats
        s["steps"] += 1
        s["busy_s"] += busy
        s["span_s"] = span

    def stats(self, reset: bool = False) -> dict[str, float]:
        """Steps (and those through CUDA graphs), busy seconds, seconds from the first step's
        start to the last one's end, the idle fraction of that span, and host seconds blocked
        receiving."""
        s = dict(self._stats)
        s["idle_fraction"] = 1.0 - s["busy_s"] / s["span_s"] if s["span_s"] > 0 else 0.0
        if reset:
            self._span_start = None
            self._stats = {k: 0 if k.endswith("steps") else 0.0 for k in self._stats}
        return s

    def _mark(self) -> Marker:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()
