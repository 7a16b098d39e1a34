"""The model runner's verify step, driven by hand-built steps: drafts after the last token, one
logits row per position, and other rows' per-row inputs (grammar masks) still in place."""
from __future__ import annotations

import numpy as np

from tests.worker.worker_helpers import Step, make_worker, new_req

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
PROMPT_A = [11, 12, 13, 14, 15, 16]


def _worker():
    return make_worker("llama", speculative_config=NGRAM)


def _first_token(worker) -> int:
    step = Step({"a": 6}, new=[new_req("a", PROMPT_A, [0, 1, 2])])
    return worker.collect(worker.execute_model(step.output())).sampled_token_ids[0][0]


def test_verify_step_emits_the_plain_steps_tokens() -> None:
    plain = _worker()
    a1 = _first_token(plain)
    want = []
    for i in range(3):
        out = Step({"a": 1}, computed={"a": 6 + i}).output()
        want += plain.collect(plain.execute_model(out)).sampled_token_ids[0]
    # drafts: the right first token, then a wrong one: 1 accepted + the replacement
    w = _worker()
    assert _first_token(w) == a1
    out = Step({"a": 3}, computed={"a": 6}).output()
    out.scheduled_spec_decode_tokens = {"a": [want[0], (want[1] + 1) % 500]}
    res = w.collect(w.execute_model(out))
    assert res.sampled_token_ids == [want[:2]]
    # the worker kept the accepted tokens: the next plain step continues from them
    out = Step({"a": 1}, computed={"a": 8}).output()
    assert w.collect(w.execute_model(out)).sampled_token_ids == [want[2:3]]


def test_grammar_row_after_a_verify_row_gets_its_own_mask() -> None:
    w = _worker()
    _first_token(w)
    step = Step({"a": 3, "b": 3}, computed={"a": 6}, new=[new_req("b", [21, 22, 23], [3])])
    out = step.output()
    out.scheduled_spec_decode_tokens = {"a": [5, 6]}
    vocab = w.config.model.vocab_size
    mask = np.zeros((1, -(-vocab // 32)), np.int32)
    mask[0, 77 // 32] = 1 << (77 % 32)  # only token 77
    out.structured_req_ids, out.grammar_bitmask = ["b"], mask
    res = w.collect(w.execute_model(out))
    assert res.sampled_token_ids[1] == [77]
    assert 1 <= len(res.sampled_token_ids[0]) <= 3


def test_a_verify_step_launched_past_is_collected_before_the_next() -> None:
    # NOTE: tensor-parallel ranks > 0 may launch step N + 1 before collecting step N.
    w = _worker()
    a1 = _first_token(w)
    out = Step({"a": 3}, computed={"a": 6}).output()
    out.scheduled_spec_decode_tokens = {"a": [7, 8]}
    first = w.execute_model(out)
    accepted = None
    ref = _worker()
    assert _first_token(ref) == a1
    ref_out = Step({"a": 3}, computed={"a": 6}).output()
    ref_out.scheduled_spec_decode_tokens = {"a": [7, 8]}
    accepted = ref.collect(ref.execute_model(ref_out)).sampled_token_ids[0]
    computed = 6 + len(accepted)
    second = w.execute_model(Step({"a": 1}, computed={"a": computed}).output())
    assert w.collect(first).sampled_token_ids == [accepted]
    want = ref.collect(ref.execute_model(Step({"a": 1}, computed={"a": computed}).output()))
    assert w.collect(second).sampled_token_ids == want.sampled_token_ids
