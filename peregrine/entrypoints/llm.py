"""The offline API: `LLM(model=...).generate(prompts, sampling_params)` and `.chat(messages)`."""
from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

from peregrine.config import EngineArgs
from peregrine.engine.llm_engine import LLMEngine
from peregrine.entrypoints.chat_utils import has_chat_template, render_chat
from peregrine.outputs import RequestOutput
from peregrine.sampling_params import RequestOutputKind, SamplingParams

Prompt = str | list[int]


class LLM:
    """Runs batches of prompts to completion on one engine (names as in vLLM)."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        known = set(EngineArgs.__dataclass_fields__)
        unknown = sorted(set(engine_args) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s): {', '.join(unknown)}")
        self.engine = LLMEngine.from_engine_args(EngineArgs(model=model, **engine_args))
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the engine (its core process and workers, if any) and release the device."""
        self.engine.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return self.engine.get_default_sampling_params()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Generate completions for every prompt; outputs come back in prompt order.

        A prompt is a string, a list of token ids, or vLLM's dict form (`{"prompt": text}` or
        `{"prompt_token_ids": ids}`); `prompts` is one prompt or a list of them.
        """
        prompts = _normalize_prompts(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(priority)} priorities")
        ids: list[str] = []
        try:
            for i, (prompt, sp) in enumerate(zip(prompts, params)):
                rid = str(next(self._ids))
                sp = sp.clone()
                sp.output_kind = RequestOutputKind.FINAL_ONLY
                self.engine.add_request(rid, prompt, sp, priority=priority[i] if priority else 0)
                ids.append(rid)
        except Exception:
            self.engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True,
             chat_template: str | None = None) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to each conversation, then generate."""
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("chat needs a tokenizer (the engine runs with skip_tokenizer_init=True)")
        if chat_template is None and not has_chat_template(tok):
            raise ValueError("the tokenizer has no chat template; pass chat_template=...")
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [render_chat(tok, conv, add_generation_prompt, chat_template) for conv in convs]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        start, out_tokens = time.perf_counter(), 0
        try:
            while len(done) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        out_tokens += sum(len(o.token_ids) for o in out.outputs)
                        if bar is not None:
                            rate = out_tokens / max(time.perf_counter() - start, 1e-9)
                            bar.set_postfix_str(f"output: {rate:.1f} tok/s")
                            bar.update(1)
        except BaseException:
            self.engine.abort_request([i for i in ids if i not in done])
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[i] for i in ids]


def _normalize_prompts(prompts: Any) -> list[str | list[int]]:
    """One prompt or a list of them, as strings or token-id lists; anything else is a TypeError."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and
                                            isinstance(prompts[0], int)):
        prompts = [prompts]  # one prompt
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a prompt or a list of prompts, not "
                        f"{type(prompts).__name__}")
    return [_one_prompt(p) for p in prompts]


def _one_prompt(p: Any) -> str | list[int]:
    if isinstance(p, str):
        return p
    if isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return p
    if isinstance(p, dict):
        keys = set(p)
        if keys == {"prompt"} and isinstance(p["prompt"], str):
            return p["prompt"]
        if keys == {"prompt_token_ids"}:
            return _one_prompt(list(p["prompt_token_ids"]))
        raise TypeError(f"a prompt dict takes exactly one of 'prompt' (text) or "
                        f"'prompt_token_ids'; got keys {sorted(keys)}")
    raise TypeError(f"a prompt is a string, a list of token ids or a prompt dict, not "
                    f"{type(p).__name__}")
