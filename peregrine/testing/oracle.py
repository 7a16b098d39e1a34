"""transformers as the oracle: greedy continuations and per-step log-softmax rows (float32)."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch


def hf_greedy(path: str | Path, prompts: Callable[[int], list[list[int]]], new_tokens: int
              ) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """transformers' greedy tokens for prompts(vocab_size) on the checkpoint at `path`, never
    stopping early (like ignore_eos), and the full log-softmax row of every generated step."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    tokens, logprobs = [], []
    for prompt in prompts(model.config.vocab_size):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=new_tokens, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=0)
        tokens.append(out.sequences[0, len(prompt):].tolist())
        logprobs.append([torch.log_softmax(x[0].float(), -1) for x in out.logits])
    return tokens, logprobs
