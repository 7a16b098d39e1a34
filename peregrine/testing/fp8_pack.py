"""Write W8A8 checkpoints from a 16/32-bit one, in the published layouts, with a reference twin.

- `write_hf_fp8`: Hugging Face `fp8` (quant_method "fp8"): float8_e4m3fn `weight`, block scales
  `weight_scale_inv` (ceil(N / bn), ceil(K / bk)) with `weight_block_size`, or one per-tensor
  `weight_scale` (+ `input_scale` for activation_scheme "static").
- `write_compressed_tensors`: compressed-tensors as llm-compressor saves it: one config group
  targeting "Linear", `ignore: ["lm_head"]`, `format` float-quantized / int-quantized, tensors
  `weight`, `weight_scale` ((N, 1) per channel, (1,) per tensor, blocks for FP8_BLOCK) and
  `input_scale` (1,) for static activations.

Each writer also saves `<dst>-reference`: the same model with every quantized weight replaced by
its dequantized value, so the quantized model must match it up to activation rounding. Static
input scales are calibrated (max |input| / qmax) by running that reference on `calib_tokens`.
"""
from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from peregrine.kernels.fp8_quant import (FP8_DTYPE, FP8_MAX, INT8_MAX, block_dequantize,
                                         quantize_with_scale)

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CT_SCHEMES = ("fp8_dynamic", "fp8_static", "fp8_block", "int8_dynamic", "int8_static")
DEFAULT_CALIB = list(range(3, 200, 7))


def quantize_per_channel(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) -> (q (N, K) in dtype, scale (N, 1) fp32), symmetric, one scale per row."""
    qmax = FP8_MAX if dtype == FP8_DTYPE else INT8_MAX
    scale = (w.float().abs().amax(dim=1, keepdim=True) / qmax).clamp(min=1e-12)
    return quantize_with_scale(w, scale, dtype), scale


def quantize_per_tensor(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    qmax = FP8_MAX if dtype == FP8_DTYPE else INT8_MAX
    scale = (w.float().abs().amax() / qmax).clamp(min=1e-12).reshape(1)
    return quantize_with_scale(w, scale, dtype), scale


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) -> (q (N, K) fp8, scale (ceil(N / bn), ceil(K / bk)) fp32)."""
    n, k = w.shape
    bn, bk = block
    nb, kb = -(-n // bn), -(-k // bk)
    padded = torch.nn.functional.pad(w.float(), (0, kb * bk - k, 0, nb * bn - n))
    scale = padded.abs().view(nb, bn, kb, bk).amax(dim=(1, 3)) / FP8_MAX
    scale = scale.clamp(min=1e-12)  # (nb, kb)
    full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]  # (N, K)
    return quantize_with_scale(w, full, FP8_DTYPE), scale


def _is_quantized(name: str, skip: tuple[str, ...]) -> bool:
    module = name[:-len(".weight")] if name.endswith(".weight") else None
    return (module is not None and module.rsplit(".", 1)[-1] in PROJECTIONS
            and not any(module == s or module.endswith("." + s) for s in skip))


def _load(src: Path) -> dict[str, torch.Tensor]:
    from peregrine.worker.loader import iterate_safetensors
    return dict(iterate_safetensors(str(src)))


def _copy_folder(src: Path, dst: Path, tensors: dict[str, torch.Tensor],
                 quantization_config: dict[str, Any] | None) -> None:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors",
                                                            "model.safetensors.index.json"))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    if quantization_config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        cfg["quantization_config"] = quantization_config
        (dst / "config.json").write_text(json.dumps(cfg, indent=2))


def calibrate_input_amax(model_dir: Path, tokens: list[int]) -> dict[str, float]:
    """max |input| of every linear module (checkpoint name, e.g. model.layers.0.mlp.up_proj)
    over one float32 prefill of `tokens` through the torch backend."""
    from peregrine.attention import get_attention_backend
    from peregrine.config import EngineArgs
    from peregrine.layers.linear import LinearBase
    from peregrine.testing.steps import one_prefill
    from peregrine.worker.loader import load_model
    cfg = EngineArgs(model=str(model_dir), dtype="float32", device="cpu",
                     skip_tokenizer_init=True).create_engine_config().model
    model = load_model(cfg, get_attention_backend("torch"), torch.device("cpu"))
    amax: dict[str, float] = {}

    def hook(module: LinearBase, args: tuple[torch.Tensor, ...]) -> None:
        for prefix in module.prefixes:
            amax[prefix] = max(amax.get(prefix, 0.0), float(args[0].abs().max()))

    handles = [m.register_forward_pre_hook(hook) for m in model.modules()
               if isinstance(m, LinearBase)]
    caches, meta = one_prefill(cfg, len(tokens), num_blocks=-(-len(tokens) // 16))
    with torch.inference_mode():
        model(torch.tensor(tokens), torch.arange(len(tokens)), caches, meta)
    for h in handles:
        h.remove()
    return amax


def _write(src: Path, dst: Path, quantize, config: dict[str, Any], skip: tuple[str, ...],
           static: torch.dtype | None, calib_tokens: list[int]) -> Path:
    """quantize(name, w) -> (checkpoint tensors for the module, dequantized weight)."""
    tensors = _load(src)
    quantized: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if _is_quantized(name, skip):
            stored, deq = quantize(t)
            module = name[:-len("weight")]
            quantized.update({module + k: v for k, v in stored.items()})
            reference[name] = deq.to(t.dtype)
        else:
            quantized[name] = reference[name] = t
    ref_dir = dst.parent / f"{dst.name}-reference"
    _copy_folder(src, ref_dir, reference, None)
    if static is not None:
        qmax = FP8_MAX if static == FP8_DTYPE else INT8_MAX
        for module, a in calibrate_input_amax(ref_dir, calib_tokens).items():
            if module + ".weight_scale" in quantized:
                quantized[module + ".input_scale"] = torch.tensor([max(a, 1e-6) / qmax])
    _copy_folder(src, dst, quantized, config)
    return dst


def write_hf_fp8(src: Path, dst: Path, *, block: tuple[int, int] | None = (128, 128),
                 activation_scheme: str = "dynamic", skip: tuple[str, ...] = (),
                 calib_tokens: list[int] = DEFAULT_CALIB) -> Path:
    """A Hugging Face fp8 checkpoint of `src` at `dst` (and its reference at dst-reference)."""
    config: dict[str, Any] = {"quant_method": "fp8", "fmt": "e4m3",
                              "activation_scheme": activation_scheme}
    if skip:
        config["modules_to_not_convert"] = list(skip)
    if block is not None:
        config["weight_block_size"] = list(block)

        def quantize(w):
            q, s = quantize_blocks(w, block)
            return {"weight": q, "weight_scale_inv": s}, block_dequantize(q, s, block)
    else:
        def quantize(w):
            q, s = quantize_per_tensor(w, FP8_DTYPE)
            return {"weight": q, "weight_scale": s.reshape(())}, q.float() * s
    static = FP8_DTYPE if activation_scheme == "static" else None
    return _write(src, dst, quantize, config, skip, static, calib_tokens)


def _args(kind: str, strategy: str, dynamic: bool, **extra: Any) -> dict[str, Any]:
    args = {"num_bits": 8, "type": kind, "symmetric": True, "group_size": None,
            "strategy": strategy, "block_structure": None, "dynamic": dynamic, "actorder": None,
            "observer": None if dynamic else "minmax", "observer_kwargs": {}}
    args.update(extra)
    return args


def compressed_tensors_config(scheme: str, block: tuple[int, int] = (128, 128),
                              ignore: tuple[str, ...] = ("lm_head",)) -> dict[str, Any]:
    """The quantization_config llm-compressor writes for `scheme` (one of CT_SCHEMES)."""
    if scheme not in CT_SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r} (expected one of {', '.join(CT_SCHEMES)})")
    kind = "float" if scheme.startswith("fp8") else "int"
    fmt = "float-quantized" if kind == "float" else "int-quantized"
    if scheme == "fp8_block":
        weights = _args(kind, "block", False, block_structure=list(block))
        inputs = _args(kind, "group", True, group_size=block[1])
    elif scheme.endswith("static"):
        weights = _args(kind, "channel", False)
        inputs = _args(kind, "tensor", False)
    else:
        weights = _args(kind, "channel", False)
        inputs = _args(kind, "token", True)
    group = {"targets": ["Linear"], "weights": weights, "input_activations": inputs,
             "output_activations": None, "format": fmt}
    return {"quant_method": "compressed-tensors", "format": fmt,
            "config_groups": {"group_0": group},
            "ignore": list(ignore), "kv_cache_scheme": None, "global_compression_ratio": None,
            "quantization_status": "compressed", "sparsity_config": {}, "transform_config": {},
            "version": "0.12.2"}


def write_compressed_tensors(src: Path, dst: Path, scheme: str, *,
                             block: tuple[int, int] = (128, 128),
                             ignore: tuple[str, ...] = ("lm_head",),
                             calib_tokens: list[int] = DEFAULT_CALIB) -> Path:
    """A compressed-tensors W8A8 checkpoint of `src` at `dst` (and its reference)."""
    config = compressed_tensors_config(scheme, block, ignore)
    dtype = FP8_DTYPE if scheme.startswith("fp8") else torch.int8

    def quantize(w):
        if scheme == "fp8_block":
            q, s = quantize_blocks(w, block)
            return {"weight": q, "weight_scale": s.to(w.dtype)}, block_dequantize(q, s.to(w.dtype),
                                                                                  block)
        q, s = quantize_per_channel(w, dtype)
        # NOTE: llm-compressor keeps scales in the model's dtype; the reference uses those values.
        s = s.to(w.dtype)
        return {"weight": q, "weight_scale": s}, q.float() * s.float()
    static = dtype if scheme.endswith("static") else None
    return _write(src, dst, quantize, config, ignore, static, calib_tokens)


def round_linear_inputs(model: torch.nn.Module, dtype: torch.dtype,
                        group: int | None = None, rows: int | None = None,
                        static: dict[str, float] | None = None) -> list[Any]:
    """Forward pre-hooks on every linear layer of a float model that round its input the way a
    W8A8 layer does (dynamic, per token or per group of inputs; with `static`, by each layer's
    fixed per-tensor scale, keyed by its module name), only its first `rows` rows when given;
    returns the hook handles. The model must run eagerly (no CUDA graph replays it)."""
    from peregrine.kernels.fp8_quant import per_token_group_quant_ref, quantize_with_scale
    from peregrine.layers.linear import LinearBase

    def hook(module: LinearBase, args: tuple[torch.Tensor, ...], name: str
             ) -> tuple[torch.Tensor]:
        x = args[0]  # (T, K)
        if static is not None:
            scale = torch.tensor(static[name])
            r = (quantize_with_scale(x, scale, dtype).float() * scale).to(x.dtype)
        else:
            q, s = per_token_group_quant_ref(x, dtype, group)  # (T, K), (T, K / group)
            k = x.shape[1]
            r = (q.float() * s.repeat_interleave(group or k, 1)[:, :k]).to(x.dtype)
        return (r if rows is None else torch.cat([r[:rows], x[rows:]]),)

    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, LinearBase)]
    missing = [n for n, _ in linears if static is not None and n not in static]
    if missing:
        raise KeyError(f"no static input scale for {missing}")
    return [m.register_forward_pre_hook(functools.partial(hook, name=n)) for n, m in linears]


def engine_model(llm: Any) -> torch.nn.Module:
    """The model inside an in-process LLM."""
    return llm.engine.core_client.core.executor.worker.model


def score_generation(path: Path, ref_path: Path, act_dtype: torch.dtype, group: int | None = None,
                     max_tokens: int = 6, dtype: str = "float32",
                     decode_unrounded: bool = False,
                     exact_reference: bool = False,
                     prompts: list[list[int]] | None = None,
                     static: dict[str, float] | None = None) -> dict[str, list[float]]:
    """Greedy generation from the quantized checkpoint at `path` (in `dtype`, prefix caching,
    chunked prefill in 16-token steps; the second prompt reuses the first one's prefix blocks),
    then the same tokens teacher-forced through the reference twin, plainly and with its linear
    inputs rounded like W8A8 activations (with decode_unrounded, only the prompt's rows: where
    decode steps of one row multiply x as it is, the CUDA GEMV path). Returns the generated
    tokens' logprobs under each: {"quantized": [...], "reference": [...],
    "reference_rounded": [...]}; with exact_reference also "reference_rounded_fp32", the rounded
    reference run in float32 (what a `dtype` run of the same model is off by, measured).
    prompts: token-id prompts to use instead of the default two (which need 305 token ids);
    static: per-tensor input scales by module name (round_linear_inputs) for static schemes."""
    from peregrine.entrypoints.llm import LLM
    from peregrine.sampling_params import SamplingParams
    if prompts is None:
        prefix = [(7 * i + 3) % 500 + 4 for i in range(40)]
        prompts = [prefix + [11, 12, 13], prefix + [300, 301, 302, 303, 304]]
    common = dict(dtype=dtype, skip_tokenizer_init=True, max_model_len=128, seed=0)
    llm = LLM(str(path), enable_prefix_caching=True, enable_chunked_prefill=True,
              max_num_batched_tokens=16, **common)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1, ignore_eos=True)
    outs = [llm.generate([p], sp, use_tqdm=False)[0].outputs[0] for p in prompts]
    del llm
    scores: dict[str, list[float]] = {"quantized": []}
    for p, o in zip(prompts, outs):
        scores["quantized"] += [o.logprobs[i][t].logprob for i, t in enumerate(o.token_ids)]
    forced = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    runs = [("reference", dtype, False), ("reference_rounded", dtype, True)]
    if exact_reference:
        runs.append(("reference_rounded_fp32", "float32", True))
    refs: dict[str, Any] = {}
    for key, ref_dtype, rounded in runs:
        if ref_dtype not in refs:
            refs.clear()  # one reference engine at a time
            # NOTE: eager: a CUDA graph replays the kernels it captured at start-up, so the
            # rounding hooks registered afterwards would never run on the GPU.
            refs[ref_dtype] = LLM(str(ref_path), enable_prefix_caching=False,
                                  enforce_eager=True, **{**common, "dtype": ref_dtype})
        ref = refs[ref_dtype]
        scores[key] = []
        for p, o in zip(prompts, outs):
            rows = len(p) if decode_unrounded else None
            hooks = round_linear_inputs(engine_model(ref), act_dtype, group, rows, static) \
                if rounded else []
            plp = ref.generate([p + list(o.token_ids)], forced, use_tqdm=False)[0].prompt_logprobs
            scores[key] += [plp[len(p) + i][t].logprob for i, t in enumerate(o.token_ids)]
            for h in hooks:
                h.remove()
    return scores
