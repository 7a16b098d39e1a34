"""Speculative decoding: proposers (n-gram, draft model) and lossless verification."""
from peregrine.spec_decode.config import SpeculativeConfig
from peregrine.spec_decode.proposer import (Proposer, ProposeInput, build_proposer,
                                            get_proposer_class, register_proposer)

__all__ = ["ProposeInput", "Proposer", "SpeculativeConfig", "build_proposer",
           "get_proposer_class", "register_proposer"]
