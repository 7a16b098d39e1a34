"""`SpeculativeConfig`: what `speculative_config` (vLLM's keys) resolves to, validated."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from peregrine.config import EngineArgs, ModelConfig
    from peregrine.sampling_params import SamplingParams

SPEC_METHODS = ("ngram", "draft_model")
SPEC_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
             "model", "quantization", "disable_by_batch_size")
DEFAULT_PROMPT_LOOKUP_MAX = 4
DEFAULT_PROMPT_LOOKUP_MIN = 1
# Above this many running requests a step decodes plainly: a verify step costs k + 1 tokens per
# request, which stops paying once the step is compute-bound (benchmarks/spec_bench.py sweeps it).
DEFAULT_DISABLE_BY_BATCH_SIZE = 32


def _bad(key: str, msg: str) -> ValueError:
    return ValueError(f"invalid speculative_config.{key}: {msg}")


def _int(raw: dict[str, Any], key: str, default: int | None) -> int | None:
    value = raw.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(key, f"expected an integer, got {value!r}")
    return value


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: who proposes (method), how many tokens, when to stand down."""

    method: str  # ngram | draft_model
    num_speculative_tokens: int
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP_MAX  # ngram: longest suffix matched
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP_MIN  # ngram: shortest suffix matched
    model: str | None = None  # draft_model: the draft's local folder
    quantization: str | None = None  # draft_model: online quantization of the draft (rtn, fp8)
    # Steps with more running requests than this decode plainly (None: never).
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE
    # draft_model: the draft's resolved config (same dtype as the target's, its own layers).
    draft: ModelConfig | None = field(default=None, repr=False, compare=False)

    @property
    def k(self) -> int:
        return self.num_speculative_tokens

    @classmethod
    def from_raw(cls, raw: dict[str, Any] | str, args: EngineArgs,
                 target: ModelConfig) -> SpeculativeConfig:
        """Validate a `speculative_config` dict (or its JSON text, as the CLI passes it)."""
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ValueError(f"invalid speculative_config: not JSON ({e.msg} at "
                                 f"character {e.pos}): {raw!r}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"invalid speculative_config: expected a JSON object / dict, got "
                             f"{type(raw).__name__}")
        unknown = sorted(set(raw) - set(SPEC_KEYS))
        if unknown:
            raise ValueError(f"invalid speculative_config: unknown key(s) {', '.join(unknown)} "
                             f"(known: {', '.join(SPEC_KEYS)})")
        method = raw.get("method")
        if method is None:
            method = "draft_model" if raw.get("model") is not None else None
        if method is None:
            raise _bad("method", "missing (ngram, or give a draft `model`)")
        if method not in SPEC_METHODS:
            raise _bad("method", f"{method!r} (expected one of {', '.join(SPEC_METHODS)})")
        k = _int(raw, "num_speculative_tokens", None)
        if k is None:
            raise _bad("num_speculative_tokens", "missing (how many tokens to propose per step)")
        if k < 1:
            raise _bad("num_speculative_tokens", f"must be >= 1, got {k}")
        disable = _int(raw, "disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE)
        if disable is not None and disable < 1:
            raise _bad("disable_by_batch_size", f"must be >= 1 (or null: never), got {disable}")
        if args.pipeline_parallel_size != 1:
            raise ValueError("invalid speculative_config: not supported with "
                             "pipeline_parallel_size > 1")
        if method == "ngram":
            for key in ("model", "quantization"):
                if raw.get(key) is not None:
                    raise _bad(key, "only a draft_model has one (method is ngram)")
            lmax = _int(raw, "prompt_lookup_max", DEFAULT_PROMPT_LOOKUP_MAX)
            lmin = _int(raw, "prompt_lookup_min", DEFAULT_PROMPT_LOOKUP_MIN)
            assert lmax is not None and lmin is not None
            if lmin < 1:
                raise _bad("prompt_lookup_min", f"must be >= 1, got {lmin}")
            if lmax < lmin:
                raise _bad("prompt_lookup_min", f"{lmin} > prompt_lookup_max {lmax}")
            return cls("ngram", k, lmax, lmin, disable_by_batch_size=disable)
        for key in ("prompt_lookup_max", "prompt_lookup_min"):
            if raw.get(key) is not None:
                raise _bad(key, "only the ngram method has one")
        return cls._draft_model(raw, args, target, k, disable)

    @classmethod
    def _draft_model(cls, raw: dict[str, Any], args: EngineArgs, target: ModelConfig, k: int,
                     disable: int | None) -> SpeculativeConfig:
        import dataclasses

        from peregrine.config import EngineArgs, ModelConfig
        from peregrine.hub import resolve_model_path
        from peregrine.layers.quantization import get_quantization_config
        name = raw.get("model")
        if not isinstance(name, str) or not name:
            raise _bad("model", f"a draft_model needs the draft's folder or hub id, got {name!r}")
        quant = raw.get("quantization")
        if quant is not None:
            if not isinstance(quant, str):
                raise _bad("quantization", f"expected a method name, got {quant!r}")
            try:
                get_quantization_config(quant)
            except ValueError as e:
                raise _bad("quantization", str(e)) from None
        if args.tensor_parallel_size != 1:
            raise ValueError("invalid speculative_config: a draft model is not supported with "
                             "tensor_parallel_size > 1 yet (the ngram method is)")
        try:
            folder = resolve_model_path(name, None, args.download_dir)
            dtype = str(target.dtype).replace("torch.", "")
            draft_args = dataclasses.replace(
                EngineArgs(), model=name, dtype=dtype, load_format=args.load_format,
                skip_tokenizer_init=True, seed=args.seed, quantization=quant,
                max_model_len=target.max_model_len)
            draft = ModelConfig.from_args(draft_args, folder)
        except ValueError as e:
            raise _bad("model", f"{name!r}: {e}") from None
        if draft.vocab_size != target.vocab_size:
            raise _bad("model", f"the draft's vocab_size {draft.vocab_size} differs from the "
                       f"target's {target.vocab_size}; both must share one tokenizer")
        return cls("draft_model", k, model=folder, quantization=quant,
                   disable_by_batch_size=disable, draft=draft)


def speculation_allowed(params: SamplingParams) -> bool:
    """Whether a request may verify drafts: a verify step samples each position as its own row,
    which is exact unless sampling depends on the tokens drawn earlier in the same step
    (repetition, presence and frequency penalties, bad_words, structured outputs)."""
    return (params.repetition_penalty == 1.0 and params.presence_penalty == 0.0
            and params.frequency_penalty == 0.0 and not params.bad_words
            and params.structured_outputs is None)
