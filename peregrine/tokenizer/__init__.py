"""Loading a model's tokenizer: a plain fast tokenizer through `tokenizers` alone (FastTokenizer,
milliseconds), any other through transformers' AutoTokenizer (seconds: it imports transformers)."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from peregrine import envs
from peregrine.tokenizer.fast import FastTokenizer, plain_fast_config

logger = logging.getLogger("peregrine")

__all__ = ["FastTokenizer", "load_tokenizer", "plain_fast_config", "transformers_tokenizer"]


def load_tokenizer(path: str) -> Any:
    """The tokenizer of a local folder (no remote code, no hub); ValueError when there is none."""
    if not envs.transformers_tokenizer() and Path(path).is_dir():
        cfg, why = plain_fast_config(path)
        if cfg is not None:
            try:
                return FastTokenizer.from_folder(path)
            except ValueError as e:
                why = str(e)
            except Exception as e:  # a tokenizer.json the tokenizers library cannot read
                why = f"{type(e).__name__}: {e}"
        logger.debug("tokenizer of %s loads through transformers: %s", path, why)
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"could not load a tokenizer from {path!r} ({e}); pass "
                         "skip_tokenizer_init=True to use token ids only") from e


def transformers_tokenizer(tokenizer: Any) -> Any:
    """`tokenizer` as a transformers tokenizer (a FastTokenizer's folder loaded by transformers)."""
    convert = getattr(tokenizer, "transformers_tokenizer", None)
    return convert() if callable(convert) else tokenizer
