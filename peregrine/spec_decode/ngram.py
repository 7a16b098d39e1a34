"""The n-gram (prompt lookup) proposer: drafts copied from the request's own earlier tokens.

The longest suffix of the tokens, between prompt_lookup_min and prompt_lookup_max tokens long,
that occurred earlier (the most recent such occurrence) predicts the k tokens that followed it.
Code edits, quoting and extraction repeat the prompt, so many drafts are accepted there; on text
that does not repeat, nothing matches and nothing is proposed (the step is a plain decode).
"""
from __future__ import annotations

import numpy as np

from peregrine.spec_decode.proposer import ProposeInput, Proposer, register_proposer

# NOTE: the search looks at the last this-many tokens only, so a step's cost is bounded for long
# contexts: O(window x prompt_lookup_max) vectorised comparisons per request.
NGRAM_SEARCH_WINDOW = 8192


def ngram_propose(tokens: np.ndarray, num_draft: int, lookup_min: int, lookup_max: int,
                  window: int = NGRAM_SEARCH_WINDOW) -> np.ndarray:
    """Up to `num_draft` tokens following the most recent earlier occurrence of the longest
    suffix of `tokens` of lookup_min..lookup_max tokens; empty when none occurs."""
    h = np.asarray(tokens)[-window:]  # (N,)
    n = h.size
    if num_draft <= 0 or n < lookup_min + 1:
        return h[:0]
    ends = np.arange(n - 1)  # (N-1,) candidate end of an earlier occurrence
    ok = h[:n - 1] == h[n - 1]  # (N-1,) the occurrence's last token matches
    length = ok.astype(np.int64)  # (N-1,) matched suffix length, up to lookup_max
    for back in range(1, min(lookup_max, n - 1)):
        ok &= ends >= back
        ok &= h[np.maximum(ends - back, 0)] == h[n - 1 - back]
        if not ok.any():
            break
        length += ok
    best = int(length.max())
    if best < lookup_min:
        return h[:0]
    end = int(np.flatnonzero(length == best)[-1])  # the most recent longest match
    return h[end + 1:end + 1 + num_draft]


@register_proposer("ngram")
class NgramProposer(Proposer):
    """Prompt lookup over each request's tokens; no model, no KV cache, no state."""

    def propose(self, inp: ProposeInput) -> list[list[int]]:
        spec = self.spec
        return [ngram_propose(tokens, int(d), spec.prompt_lookup_min,
                              spec.prompt_lookup_max).tolist()
                for tokens, d in zip(inp.token_ids, inp.num_draft.tolist())]
