"""Build a model on its device and fill it from safetensors, or with dummy weights."""
from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from peregrine.attention.kv_scales import take_kv_scales
from peregrine.config import ModelConfig
from peregrine.layers.kernel_config import KernelConfig
from peregrine.layers.linear import LinearBase
from peregrine.models.protocol import BuildOptions, PipelineStage
from peregrine.models.registry import build_model

logger = logging.getLogger("peregrine")


def safetensors_files(model_dir: str) -> list[Path]:
    """The checkpoint's shard files: from model.safetensors.index.json if present, else *.safetensors."""
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: 'weight_map' is missing or empty")
        files = sorted({root / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise ValueError(f"{index} names shard {f.name!r}, which does not exist")
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in root.glob("*.bin")) + sorted(p.name for p in root.glob("*.pt"))
        hint = f" (found {', '.join(pickles)}: pickle checkpoints are not loaded)" if pickles else ""
        raise ValueError(f"model folder {model_dir!r} has no *.safetensors files{hint}")
    return files


def iterate_safetensors(model_dir: str, keep: Callable[[str], bool] | None = None
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every checkpoint tensor, or of those `keep` accepts (others are not
    read)."""
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if keep is None or keep(name):
                    yield name, f.get_tensor(name)


def load_model(cfg: ModelConfig, backend, device: torch.device,
               kernels: KernelConfig | None = None,
               stage: PipelineStage | None = None) -> nn.Module:
    """Build the registered architecture on `device` in `cfg.dtype` with `kernels` (default:
    KernelConfig.for_device(device)), quantized as cfg.quantization says, and load its weights;
    a pipeline `stage` builds and reads only its own layers (and embedding or LM head)."""
    opts = BuildOptions(dtype=cfg.dtype, backend=backend, quant_config=cfg.quantization,
                        kernels=kernels if kernels is not None else KernelConfig.for_device(device),
                        stage=stage if stage is not None else PipelineStage())
    with torch.device(device):
        model = build_model(cfg.architecture, cfg.hf_config, opts)
    if cfg.load_format == "dummy":
        init_dummy_weights(model, cfg.seed)
    else:
        # NOTE: K/V cache scales go to the Attention layers; the rest to the model. Another
        # pipeline stage's tensors are skipped unread.
        keep = getattr(model, "owns_checkpoint_tensor", None)
        model.load_weights(take_kv_scales(model, iterate_safetensors(cfg.model, keep)))
    for module in model.modules():
        if isinstance(module, LinearBase):
            module.quant_method.process_weights_after_loading(module)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    method = cfg.quantization.name if cfg.quantization is not None else "none"
    logger.info("model weights: %.2f GiB (quantization: %s, activations in %s)",
                weight_bytes / 2**30, method, str(cfg.dtype).removeprefix("torch."))
    return model.eval()


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """Random weights for benchmarks: normal(0, std) matrices, unit norms, zero biases."""
    gen: torch.Generator | None = None
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if not p.is_floating_point():  # packed quantized values: any bits will do
            if gen is None:
                gen = torch.Generator(device=p.device).manual_seed(seed)
            p.random_(generator=gen)
        elif name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith("bias"):
            p.zero_()
        else:
            if gen is None:
                gen = torch.Generator(device=p.device).manual_seed(seed)
            # NOTE: drawn on the parameter's device: an 8B model takes seconds, not minutes.
            if p.element_size() == 1:  # FP8: torch draws no normals in 8 bits; draw, then round
                p.copy_(torch.empty(p.shape, dtype=torch.float32, device=p.device)
                        .normal_(0.0, std, generator=gen))
            else:
                p.normal_(0.0, std, generator=gen)

