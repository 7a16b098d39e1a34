"""Helpers for worker tests: a CPU Worker on a tiny checkpoint, hand-built steps, a transformers
oracle (imported, not a conftest)."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from peregrine.config import EngineArgs
from peregrine.messages import (CachedRequestData, ModelRunnerOutput, NewRequestData,
                                SchedulerOutput)
from peregrine.sampling_params import SamplingParams
from peregrine.testing.checkpoints import tiny_checkpoint
from peregrine.worker.worker import Worker

BLOCK_SIZE = 4


def make_worker(arch: str = "qwen3", **engine_args) -> Worker:
    """A CPU worker (float32, block size 4) with its KV cache allocated."""
    args = dict(model=str(tiny_checkpoint(arch)), dtype="float32", device="cpu", max_model_len=64,
                block_size=BLOCK_SIZE, num_gpu_blocks_override=64, seed=0)
    config = EngineArgs(**{**args, **engine_args}).create_engine_config()
    worker = Worker(config)
    worker.initialize_cache(worker.determine_num_blocks())
    return worker


def new_req(req_id: str, prompt: list[int], blocks: list[int], computed: int = 0,
            output: list[int] | None = None, seed: int = 0, eos: tuple[int, ...] = (),
            **params) -> NewRequestData:
    params.setdefault("temperature", 0.0)
    return NewRequestData(req_id, list(prompt), SamplingParams(**params), seed, eos, list(blocks),
                          computed, list(output or []))


@dataclass
class Step:
    """One hand-built step: scheduled counts in order; new requests are given by data."""

    scheduled: dict[str, int]
    new: list[NewRequestData] = field(default_factory=list)
    computed: dict[str, int] = field(default_factory=dict)  # cached request -> computed before
    new_blocks: dict[str, list[int]] = field(default_factory=dict)
    preempted: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)

    def output(self) -> SchedulerOutput:
        new_ids = {n.req_id for n in self.new}
        cached = CachedRequestData()
        for rid in self.scheduled:
            if rid not in new_ids:
                cached.req_ids.append(rid)
                cached.new_block_ids.append(self.new_blocks.get(rid, []))
                cached.num_computed_tokens.append(self.computed[rid])
        return SchedulerOutput(self.new, cached, dict(self.scheduled),
                               sum(self.scheduled.values()), list(self.preempted),
                               list(self.finished))


def run_steps(worker: Worker, steps: list[Step], async_scheduling: bool) -> list[ModelRunnerOutput]:
    """Run the steps; async: each step is launched before the previous one is collected."""
    results: list[ModelRunnerOutput] = []
    pending = None
    for step in steps:
        handle = worker.execute_model(step.output())
        if pending is not None:
            results.append(worker.collect(pending))
        if async_scheduling:
            pending = handle
        else:
            results.append(worker.collect(handle))
    if pending is not None:
        results.append(worker.collect(pending))
    return results


@functools.lru_cache(maxsize=None)
def hf_greedy(arch: str, prompt: tuple[int, ...], num_tokens: int, repetition_penalty: float = 1.0,
              presence_penalty: float = 0.0, frequency_penalty: float = 0.0
              ) -> tuple[list[int], list[torch.Tensor], torch.Tensor]:
    """transformers' greedy tokens, the raw log-softmax row of each, and the prompt's (P, V) rows."""
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    def presence_frequency(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = input_ids[:, len(prompt):]  # (1, N) generated so far
        counts = torch.zeros_like(scores).scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - frequency_penalty * counts - presence_penalty * (counts > 0)

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint(arch), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_tokens,
                             do_sample=False, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0, repetition_penalty=repetition_penalty,
                             logits_processor=LogitsProcessorList([presence_frequency]))
        prompt_rows = torch.log_softmax(model(ids).logits[0].float(), -1)  # (P, V)
    rows = [torch.log_softmax(x[0].float(), -1) for x in out.logits]
    return out.sequences[0, len(prompt):].tolist(), rows, prompt_rows
