"""The scheduler's part of speculative decoding: whether a step verifies drafts at all, a
request's drafts scheduled as 1 + d tokens under the step's budget, the lookahead slots held for
the next step's drafts, rolling back rejected drafts, and backing off requests whose drafts keep
failing (or that the proposer finds nothing for)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from peregrine.engine.request import Request
from peregrine.spec_decode.config import speculation_allowed

if TYPE_CHECKING:
    from peregrine.config import SchedulerConfig
    from peregrine.kv_cache.manager import KVCacheManager
    from peregrine.messages import SchedulerOutput
    from peregrine.spec_decode.config import SpeculativeConfig

# A request whose drafts were all rejected this many verify steps in a row decodes plainly for a
# while (2, 4, 8, ... steps, at most SPEC_MAX_BACKOFF), so text the proposer cannot predict costs
# little more than plain decoding: nothing is proposed for it, no lookahead is held, and its
# steps can be pipelined. One accepted draft resets it. So do SPEC_EMPTY_BACKOFF_AFTER proposals
# in a row that found no draft (cheaper than a rejected verify step, so later and shorter: at
# most SPEC_EMPTY_MAX_BACKOFF steps); a found draft resets that count. A back-off ends on a step
# that is a multiple of its length, so backing-off requests propose together and the steps
# between stay pipelined.
SPEC_BACKOFF_AFTER = 4
SPEC_MAX_BACKOFF = 32
SPEC_EMPTY_BACKOFF_AFTER = 4
SPEC_EMPTY_MAX_BACKOFF = 16


def samples(req: Request, num_new: int) -> bool:
    """Whether `num_new` scheduled tokens reach req's last known token (in-flight included)."""
    return (req.num_computed_tokens + num_new
            >= len(req.all_token_ids) + req.num_output_placeholders)


class DraftScheduling:
    """One scheduler's speculative state: this step's decision and the back-offs."""

    def __init__(self, speculative: SpeculativeConfig | None, config: SchedulerConfig,
                 kv: KVCacheManager) -> None:
        self.speculative = speculative
        self.config = config
        self.kv = kv
        # Requests that may verify drafts get slots for this many positions past the step's
        # tokens, so the next step's drafts (and a draft model's KV) fit.
        self.num_lookahead = speculative.num_speculative_tokens + 1 if speculative else 0
        self.speculate = False  # this step's decision (see begin_step)
        self._no_propose: list[str] = []  # backing off: no drafts wanted after this step
        self._num_steps = 0  # steps scheduled: back-offs end on multiples of their length

    def begin_step(self, num_running: int) -> bool:
        """Decide whether this step schedules drafts and lookahead slots at all."""
        spec = self.speculative
        # NOTE: past disable_by_batch_size running requests a verify step stops paying: decode
        # plainly (and propose nothing) until the batch shrinks.
        self.speculate = spec is not None and (spec.disable_by_batch_size is None
                                               or num_running <= spec.disable_by_batch_size)
        return self.speculate

    def take_drafts(self, req: Request, num_new: int, budget: int,
                    drafts: dict[Request, list[int]]) -> bool:
        """Take req's proposed drafts into this step (trimmed to the budget, max_model_len and
        max_tokens) and hold lookahead slots; True when some drafts are scheduled."""
        proposed, req.spec_token_ids = req.spec_token_ids, []
        if not speculation_allowed(req.sampling_params):
            return False
        if req.spec_skip:
            req.spec_skip -= 1
            proposed = []
            if req.spec_skip:
                # NOTE: nothing will be proposed after this step: no drafts, no lookahead.
                self._no_propose.append(req.request_id)
                return False
        cfg = self.config
        num_d = 0
        if proposed and num_new == 1 and req.num_computed_tokens == req.num_tokens - 1:
            # NOTE: the step emits up to num_d + 1 tokens; none may pass a length limit.
            num_d = min(len(proposed), budget - 1, cfg.max_model_len - req.num_tokens - 1,
                        req.max_tokens - req.num_output_tokens - 1)
        num_d = max(num_d, 0)
        total = num_new + num_d
        look = 0
        if req.num_computed_tokens + num_new >= req.num_tokens:  # it samples: drafts may follow
            look = max(0, min(self.num_lookahead,
                              cfg.max_model_len - req.num_computed_tokens - total))
        # NOTE: drafts and lookahead are an optimisation: when the pool is tight they are dropped
        # (a plain decode follows) rather than preempting another request for them.
        if (num_d or look) and not self.kv.allocate_slots(req, total + look):
            return False
        if num_d:
            drafts[req] = proposed[:num_d]
        return num_d > 0

    def admit_lookahead(self, req: Request, end: int) -> int:
        """Lookahead slots for an admitted request whose chunk ends at token `end`: it samples
        there and may then get drafts."""
        if (not self.speculate or end < req.num_tokens
                or not speculation_allowed(req.sampling_params)):
            return 0
        return max(0, min(self.num_lookahead, self.config.max_model_len - end))

    def end_step(self, out: SchedulerOutput, scheduled: dict[Request, int],
                 drafts: dict[Request, list[int]]) -> None:
        """Write on the step's output whether drafts are proposed after it, which requests back
        off, and the drafts it verifies."""
        # NOTE: a step after which nothing is proposed can be pipelined (async scheduling): only
        # a proposal needs the step's tokens on the host before the next step is scheduled.
        no_propose = set(self._no_propose)
        out.propose_drafts = self.speculate and any(
            samples(req, n) and speculation_allowed(req.sampling_params)
            and req.request_id not in no_propose for req, n in scheduled.items())
        out.no_propose_req_ids, self._no_propose = self._no_propose, []
        self._num_steps += 1
        if drafts:
            out.scheduled_spec_decode_tokens = {r.request_id: d for r, d in drafts.items()}

    def verified(self, req: Request, num_d: int, num_tokens: int) -> int:
        """req's step verified `num_d` drafts and returned `num_tokens` tokens: roll back past the
        rejected drafts; returns how many were accepted."""
        # NOTE: the KV of rejected drafts is garbage: roll back past it (the slots stay held,
        # and blocks enter the prefix cache only when verified).
        num_accepted = num_tokens - 1
        if not 0 <= num_accepted <= num_d:
            raise ValueError(f"request {req.request_id!r} verified {num_d} "
                             f"drafts but got {num_tokens} tokens")
        req.num_computed_tokens -= num_d - num_accepted
        if num_accepted:
            req.spec_misses = 0
        else:
            self._missed(req)
        return num_accepted

    def take_proposal(self, req: Request, draft_ids: list[int], proposed_for: bool) -> None:
        """Keep the drafts proposed for req after its step for the next one; `proposed_for`: the
        step asked the proposer (SchedulerOutput.propose_drafts)."""
        req.spec_token_ids = draft_ids
        if req.spec_token_ids:
            req.spec_empty = 0
        elif (proposed_for and not req.spec_skip
                and speculation_allowed(req.sampling_params)):
            req.spec_empty += 1  # proposed for, and the proposer found nothing
            if req.spec_empty >= SPEC_EMPTY_BACKOFF_AFTER:
                self._back_off(req, req.spec_empty - SPEC_EMPTY_BACKOFF_AFTER + 1,
                               SPEC_EMPTY_MAX_BACKOFF)

    def _missed(self, req: Request) -> None:
        """A verify step accepted none of req's drafts: after SPEC_BACKOFF_AFTER in a row it backs
        off."""
        req.spec_misses += 1
        if req.spec_misses >= SPEC_BACKOFF_AFTER:
            self._back_off(req, req.spec_misses - SPEC_BACKOFF_AFTER + 1, SPEC_MAX_BACKOFF)

    def _back_off(self, req: Request, level: int, most: int) -> None:
        """No drafts for req for up to min(2 ** level, most) steps, until a step that is a
        multiple of that length (the last one proposes)."""
        period = min(2 ** level, most)
        # NOTE: the step just updated is number _num_steps - 1.
        req.spec_skip = period - (self._num_steps - 1) % period
