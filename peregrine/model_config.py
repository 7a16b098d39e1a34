"""`ModelConfig`: a model folder's config.json (and generation_config.json) read and validated
against EngineArgs; the tokenizer folder and the dtype it resolves to."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from peregrine.engine_args import invalid_arg

if TYPE_CHECKING:
    import torch

    from peregrine.engine_args import EngineArgs
    from peregrine.layers.quantization import QuantizationConfig

# NOTE: torch is imported inside the functions that need it, so that `peregrine --help` (whose
# flags come from EngineArgs) starts without importing torch.
_DTYPE_NAMES = {"float32": "float32", "float": "float32", "float16": "float16",
                "half": "float16", "bfloat16": "bfloat16"}
# A Hugging Face tokenizer folder holds at least one of these vocabulary files (or a *.tiktoken).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


@dataclass(frozen=True)
class ModelConfig:
    model: str
    tokenizer: str | None
    served_model_name: str
    architecture: str
    hf_config: dict[str, Any] = field(repr=False, hash=False, compare=False)
    dtype: torch.dtype
    max_model_len: int
    load_format: str
    skip_tokenizer_init: bool
    seed: int
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eos_token_ids: tuple[int, ...]
    generation_config: dict[str, Any] = field(repr=False, hash=False, compare=False)
    # The parsed quantization config (layers/quantization/), None when unquantized.
    quantization: QuantizationConfig | None = field(default=None, compare=False)

    @classmethod
    def from_args(cls, args: EngineArgs, model_dir: str) -> ModelConfig:
        from peregrine.layers.quantization import resolve_quantization
        path = Path(model_dir)
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise ValueError(f"model folder {model_dir!r} has no config.json (a Hugging Face "
                             "model folder holds config.json and its weights)")
        hf = json.loads(cfg_path.read_text())
        archs = hf.get("architectures") or []
        if not archs:
            raise ValueError(f"{cfg_path}: field 'architectures' is missing")
        for key in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size"):
            if key not in hf:
                raise ValueError(f"{cfg_path}: required field {key!r} is missing")
        num_heads = int(hf["num_attention_heads"])
        num_kv_heads = int(hf.get("num_key_value_heads") or num_heads)
        head_dim = int(hf.get("head_dim") or hf["hidden_size"] // num_heads)
        if num_heads % num_kv_heads:
            raise ValueError(f"{cfg_path}: num_attention_heads {num_heads} is not a multiple of "
                             f"num_key_value_heads {num_kv_heads}")
        gen_cfg: dict[str, Any] = {}
        gen_path = path / "generation_config.json"
        if gen_path.is_file():
            gen_cfg = json.loads(gen_path.read_text())
        eos = gen_cfg.get("eos_token_id", hf.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        dtype = _resolve_dtype(args.dtype, hf)
        derived_max = int(hf.get("max_position_embeddings") or 2048)
        max_len = args.max_model_len or derived_max
        if max_len > derived_max:
            raise invalid_arg("max_model_len", f"{max_len} exceeds the model's limit {derived_max} "
                              "(max_position_embeddings in config.json)")
        if max_len < 1:
            raise invalid_arg("max_model_len", f"must be >= 1, got {max_len}")
        if args.load_format not in ("auto", "safetensors", "dummy"):
            raise invalid_arg("load_format",
                              f"{args.load_format!r} (expected auto, safetensors or dummy)")
        return cls(
            model=str(path), tokenizer=_tokenizer_path(args, path),
            served_model_name=args.served_model_name or (args.model or "peregrine-demo"),
            architecture=archs[0], hf_config=hf, dtype=dtype, max_model_len=int(max_len),
            load_format=args.load_format, skip_tokenizer_init=args.skip_tokenizer_init,
            seed=args.seed, vocab_size=int(hf["vocab_size"]), hidden_size=int(hf["hidden_size"]),
            num_layers=int(hf["num_hidden_layers"]), num_heads=num_heads,
            num_kv_heads=num_kv_heads, head_dim=head_dim, eos_token_ids=eos_ids,
            generation_config=gen_cfg,
            quantization=resolve_quantization(hf, args.quantization),
        )


def _tokenizer_path(args: EngineArgs, model_dir: Path) -> str:
    """The tokenizer's folder: the model's, or --tokenizer as a folder or a hub id."""
    if args.skip_tokenizer_init:
        return args.tokenizer or str(model_dir)
    if args.tokenizer is None:
        folder = str(model_dir)
    else:
        from peregrine.hub import resolve_model_path
        folder = resolve_model_path(args.tokenizer, None, args.download_dir)
    check_tokenizer_folder(folder, given=args.tokenizer is not None)
    return folder


def check_tokenizer_folder(folder: str, given: bool = False) -> None:
    """A one-line ValueError when `folder` holds none of a Hugging Face tokenizer's files."""
    if any((Path(folder) / name).is_file() for name in TOKENIZER_FILES) or any(
            Path(folder).glob("*.tiktoken")):
        return
    what = "tokenizer folder" if given else "model folder"
    raise ValueError(f"{what} {folder!r} has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, "
                     "...): pass --tokenizer with a folder or Hugging Face id that has them, or "
                     "--skip-tokenizer-init to send token ids and get token ids back")


def _resolve_dtype(dtype: str, hf: dict[str, Any]) -> torch.dtype:
    import torch
    if dtype == "auto":
        name = str(hf.get("torch_dtype") or hf.get("dtype") or "float32").replace("torch.", "")
        return getattr(torch, _DTYPE_NAMES.get(name, "float32"))
    if dtype not in _DTYPE_NAMES:
        raise invalid_arg("dtype", f"{dtype!r} (expected auto, float32, float16 or bfloat16)")
    return getattr(torch, _DTYPE_NAMES[dtype])
