"""What the scheduler emits: each step as data for the workers (`StepEncoder`), and
`SchedulerStats` snapshots for metrics."""
from __future__ import annotations

from dataclasses import dataclass

from peregrine.engine.request import Request
from peregrine.messages import CachedRequestData, NewRequestData, SchedulerOutput


@dataclass
class SchedulerStats:
    """A snapshot for metrics; token and preemption counters are cumulative."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of KV blocks held by requests, 0..1
    prefix_cache_queries: int  # tokens looked up in the prefix cache
    prefix_cache_hits: int  # tokens found there
    num_preemptions: int  # recompute and swap
    num_swapped_out: int = 0  # preemptions that swapped the request's blocks to the CPU
    num_swapped_in: int = 0  # swapped requests resumed
    num_swapped: int = 0  # requests whose blocks are in the CPU swap space now
    cpu_cache_usage: float = 0.0  # fraction of CPU swap blocks in use, 0..1
    # Speculative decoding, cumulative: verify steps of a request, drafts verified, accepted.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0


class StepEncoder:
    """Remembers what the workers hold of each request and writes a step against it: full data
    for a request they lack, block deltas for the rest."""

    def __init__(self, send_new_tokens: bool) -> None:
        # Blocks of each request the workers already hold (absent: the workers do not know it).
        self._sent_blocks: dict[str, int] = {}
        # Pipeline parallelism (several steps in flight): the workers learn the tokens sampled
        # since a request was last sent (CachedRequestData.new_token_ids).
        self._send_new_tokens = send_new_tokens
        self._sent_outputs: dict[str, int] = {}  # output tokens of each request the workers hold

    def forget(self, request_id: str) -> None:
        """The workers drop the request (preempted or finished): sent again, it is new."""
        self._sent_blocks.pop(request_id, None)
        self._sent_outputs.pop(request_id, None)

    def encode(self, scheduled: dict[Request, int], preempted_ids: list[str],
               finished_ids: list[str]) -> SchedulerOutput:
        """The step as data: full data for requests the workers lack, block deltas for the rest."""
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        sent_blocks = self._sent_blocks
        counts: dict[str, int] = {}
        total = 0
        for req, n in scheduled.items():
            rid = req.request_id
            counts[rid] = n
            total += n
            block_ids = req.block_ids
            sent = sent_blocks.get(rid)
            sent_blocks[rid] = len(block_ids)
            if sent is None:
                new_reqs.append(NewRequestData(
                    rid, req.prompt_token_ids, req.sampling_params, req.seed, req.eos_token_ids,
                    list(block_ids), req.num_computed_tokens, list(req.output_token_ids),
                    req.max_tokens))
            else:
                cached.req_ids.append(rid)
                cached.new_block_ids.append(block_ids[sent:])
                cached.num_computed_tokens.append(req.num_computed_tokens)
            if self._send_new_tokens:
                self._add_new_tokens(req, cached, sent is None)
        # NOTE: running requests come first and the workers know them all; admitted ones (new or
        # resumed after preemption) follow, so the batch order is cached requests, then new ones.
        return SchedulerOutput(new_reqs, cached, counts, total, preempted_ids, finished_ids)

    def _add_new_tokens(self, req: Request, cached: CachedRequestData, is_new: bool) -> None:
        """Pipeline parallelism: the output tokens the workers lack go with a cached request."""
        outputs = req.output_token_ids
        if not is_new:
            cached.new_token_ids.append(outputs[self._sent_outputs[req.request_id]:])
        self._sent_outputs[req.request_id] = len(outputs)
