"""Peregrine: an LLM inference and serving engine."""
from __future__ import annotations

__version__ = "0.1.0"

from peregrine.outputs import CompletionOutput, Logprob, RequestOutput
from peregrine.sampling_params import RequestOutputKind, SamplingParams


def __getattr__(name: str):
    # NOTE: LLM / LLMEngine pull in torch model code; import lazily so `import peregrine` is cheap.
    if name == "LLM":
        from peregrine.entrypoints.llm import LLM
        return LLM
    if name == "LLMEngine":
        from peregrine.engine.llm_engine import LLMEngine
        return LLMEngine
    if name == "EngineArgs":
        from peregrine.config import EngineArgs
        return EngineArgs
    raise AttributeError(name)


__all__ = ["LLM", "LLMEngine", "EngineArgs", "SamplingParams", "RequestOutputKind",
           "RequestOutput", "CompletionOutput", "Logprob"]
