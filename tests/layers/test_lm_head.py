"""The LM head's float32 logits, returned fresh or written into a caller's buffer."""
from __future__ import annotations

import pytest
import torch

from peregrine.layers.embedding import ParallelLMHead


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_logits_into_a_buffer_equal_the_returned_ones(dtype: torch.dtype) -> None:
    head = ParallelLMHead(37, 16, dtype=dtype)
    head.weight.data.copy_(torch.randn(37, 16, generator=torch.Generator().manual_seed(0)))
    hidden = torch.randn(5, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
    fresh = head.compute_logits(hidden)
    assert fresh.dtype == torch.float32 and fresh.shape == (5, 37)
    shared = torch.full((8, 37), float("nan"))
    got = head.compute_logits(hidden, out=shared[:5])
    assert got.data_ptr() == shared.data_ptr()  # written in place, no second buffer
    assert torch.equal(shared[:5], fresh)
    assert torch.isnan(shared[5:]).all()  # rows past the batch untouched
