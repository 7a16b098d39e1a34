"""The proposer interface and its registry: adding a proposer is adding a file.

The runner builds a `ProposeInput` once a step's tokens are known on the host and asks the
proposer for drafts; the verify step next round accepts or rejects them (spec_decode/verify.py).
"""
from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch
    from torch import nn

    from peregrine.config import EngineConfig
    from peregrine.spec_decode.config import SpeculativeConfig


@dataclass
class ProposeInput:
    """The requests that should get proposals now, built by the runner after a step."""

    req_ids: list[str]
    # Per request: every token so far (prompt + outputs, including those accepted this step).
    token_ids: list[np.ndarray]
    # Per request: its block-table row; slots exist for positions < len(token_ids[i]) +
    # num_draft[i] (k + 1 past the step's tokens when the pool had room). Read-only views.
    block_ids: list[np.ndarray]
    # (R,) tokens to propose per request, in 1..k: capped so that the verify step fits the block
    # table, max_model_len and max_tokens.
    num_draft: np.ndarray


class Proposer(ABC):
    """Proposes up to k draft tokens per request; the target model verifies them."""

    def __init__(self, engine_config: EngineConfig, spec: SpeculativeConfig,
                 device: torch.device) -> None:
        self.engine_config = engine_config
        self.spec = spec
        self.device = device

    def load_model(self, target_model: nn.Module) -> None:
        """Load whatever the proposer runs (called once the target model is loaded)."""

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes of the proposer's own KV cache per block (added to the target's when sizing)."""
        return 0

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the proposer's KV cache; block ids are the target pool's."""

    @abstractmethod
    def propose(self, inp: ProposeInput) -> list[list[int]]:
        """One draft list per request of `inp`, each at most num_draft[i] long."""

    def remove_requests(self, req_ids: Iterable[str]) -> None:
        """Forget finished or preempted requests."""


_ProposerClass = type[Proposer]
# method -> "module:Class", imported on first use (a draft model pulls in its loader).
_BUILTIN: dict[str, str] = {
    "ngram": "peregrine.spec_decode.ngram:NgramProposer",
    "draft_model": "peregrine.spec_decode.draft_model:DraftModelProposer",
}
_REGISTERED: dict[str, _ProposerClass] = {}


def register_proposer(name: str) -> Callable[[_ProposerClass], _ProposerClass]:
    """Class decorator: make `cls` the proposer of speculative_config method `name`."""
    def wrap(cls: _ProposerClass) -> _ProposerClass:
        if _REGISTERED.get(name, cls) is not cls:
            raise ValueError(f"proposer {name!r} is already registered")
        _REGISTERED[name] = cls
        return cls
    return wrap


def get_proposer_class(name: str) -> _ProposerClass:
    """The proposer class of method `name`; ValueError naming the known ones."""
    if name not in _REGISTERED and name in _BUILTIN:
        module, cls_name = _BUILTIN[name].split(":")
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            raise ValueError(f"speculative method {name!r} is not available in this build "
                             f"({module} is missing)") from None
        _REGISTERED.setdefault(name, getattr(mod, cls_name))
    if name in _REGISTERED:
        return _REGISTERED[name]
    raise ValueError(f"unknown speculative method {name!r} (known: "
                     f"{', '.join(sorted({*_BUILTIN, *_REGISTERED}))})")


def build_proposer(engine_config: EngineConfig, device: torch.device) -> Proposer | None:
    """The configured proposer, or None without speculative decoding."""
    spec = engine_config.speculative
    if spec is None:
        return None
    return get_proposer_class(spec.method)(engine_config, spec, device)
