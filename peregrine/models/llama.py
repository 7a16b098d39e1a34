"""Llama-family decoder: Llama 2/3/3.1, Mistral, Qwen2 (qkv bias) and Qwen3 (q/k RMSNorm)."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from peregrine.attention.metadata import AttentionMetadata
from peregrine.distributed import divide, tp_size
from peregrine.layers.activation import SiluAndMul
from peregrine.layers.attention import Attention
from peregrine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from peregrine.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear,
                                     RowParallelLinear)
from peregrine.layers.norm import RMSNorm
from peregrine.layers.rotary import RotaryEmbedding, rope_parameters

KVCache = tuple[torch.Tensor, torch.Tensor]


def layer_windows(hf: dict[str, Any]) -> list[int | None]:
    """Each layer's sliding window (None: full attention), as transformers reads config.json:
    `layer_types` when present; else Mistral windows every layer, and Qwen2/Qwen3 (with
    use_sliding_window) the layers from max_window_layers on."""
    n = hf["num_hidden_layers"]
    window = hf.get("sliding_window")
    if not window:
        return [None] * n
    window = int(window)
    types = hf.get("layer_types")
    if types:
        if len(types) != n:
            raise ValueError(f"config.json: layer_types has {len(types)} entries for {n} layers")
        return [window if t == "sliding_attention" else None for t in types]
    if hf.get("model_type") in ("qwen2", "qwen3"):
        if not hf.get("use_sliding_window", False):
            return [None] * n
        first = int(hf.get("max_window_layers", n))
        return [window if i >= first else None for i in range(n)]
    if hf.get("model_type") == "mistral":
        return [window] * n
    return [None] * n


class DecoderAttention(nn.Module):
    def __init__(self, hf: dict[str, Any], head_dim: int, rope: RotaryEmbedding, backend,
                 qkv_bias: bool, qk_norm: bool, window: int | None = None) -> None:
        super().__init__()
        hidden = hf["hidden_size"]
        heads = hf["num_attention_heads"]
        kv_heads = hf.get("num_key_value_heads") or heads
        self.num_heads = divide(heads, tp_size(), "num_attention_heads")
        self.num_kv_heads = divide(kv_heads, tp_size(), "num_key_value_heads")
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, heads, kv_heads, bias=qkv_bias)
        o_bias = bool(hf.get("attention_bias", False)) and hf.get("model_type") != "qwen2"
        self.o_proj = RowParallelLinear(heads * head_dim, hidden, bias=o_bias)
        self.rotary_emb = rope
        eps = hf.get("rms_norm_eps", 1e-6)
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim, head_dim ** -0.5, backend,
                              sliding_window=window)

    def project(self, positions: torch.Tensor, x: torch.Tensor):
        """q (T, Hq, D), k and v (T, Hkv, D) of x (T, hidden), with q/k norm and RoPE applied."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # (T, q_size + 2 kv_size)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)  # (T, Hq, D)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        return q, k, v.reshape(t, self.num_kv_heads, self.head_dim)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.project(positions, x)
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))  # (T, hidden)


class DecoderMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, bias: bool) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], bias=bias)
        self.down_proj = RowParallelLinear(inter, hidden, bias=bias)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, hf: dict[str, Any], head_dim: int, rope: RotaryEmbedding, backend,
                 qkv_bias: bool, qk_norm: bool, window: int | None = None) -> None:
        super().__init__()
        eps = hf.get("rms_norm_eps", 1e-6)
        self.self_attn = DecoderAttention(hf, head_dim, rope, backend, qkv_bias, qk_norm, window)
        self.mlp = DecoderMLP(hf["hidden_size"], hf["intermediate_size"], bool(hf.get("mlp_bias", False)))
        self.input_layernorm = RMSNorm(hf["hidden_size"], eps)
        self.post_attention_layernorm = RMSNorm(hf["hidden_size"], eps)

    def forward(self, positions, x, residual, kv_cache, meta):
        q, k, v, residual = self.pre_attention(positions, x, residual)
        return self.post_attention(self.self_attn.attn(q, k, v, kv_cache, meta), residual)

    # NOTE: the halves around attention are what piecewise CUDA graphs capture (cuda_graphs.py).
    def pre_attention(self, positions: torch.Tensor, x: torch.Tensor,
                      residual: torch.Tensor | None):
        """Input norm (residual add included) and q/k/v: (q, k, v, residual)."""
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        return (*self.self_attn.project(positions, x), residual)

    def post_attention(self, attn_out: torch.Tensor, residual: torch.Tensor):
        """Output projection, residual add and norm, MLP: (x, residual) for the next layer."""
        x, residual = self.post_attention_layernorm(self.self_attn.o_proj(attn_out), residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    """Also serves Mistral, Qwen2 and Qwen3: they differ only in the flags set from config.json."""

    # checkpoint name suffix -> (our parameter suffix, shard index) for fused projections
    _FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, hf: dict[str, Any], backend, *, qkv_bias: bool | None = None,
                 qk_norm: bool = False) -> None:
        super().__init__()
        self.hf = hf
        if qkv_bias is None:
            qkv_bias = bool(hf.get("attention_bias", False))
        hidden = hf["hidden_size"]
        head_dim = hf.get("head_dim") or hidden // hf["num_attention_heads"]
        theta, scaling = rope_parameters(hf)
        max_pos = int(hf.get("max_position_embeddings") or 2048)
        rope = RotaryEmbedding(head_dim, max_pos, theta, scaling)
        self.embed_tokens = VocabParallelEmbedding(hf["vocab_size"], hidden)
        self.layers = nn.ModuleList(DecoderLayer(hf, head_dim, rope, backend, qkv_bias, qk_norm, w)
                                    for w in layer_windows(hf))
        self.norm = RMSNorm(hidden, hf.get("rms_norm_eps", 1e-6))
        self.tie_word_embeddings = bool(hf.get("tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(hf["vocab_size"], hidden)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states (T, hidden) for the flat step batch."""
        x = self.embed_tokens(input_ids)  # (T, hidden)
        residual = None
        for layer, cache in zip(self.layers, kv_caches):
            x, residual = layer(positions, x, residual, cache, meta)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)  # (N, V) float32

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load checkpoint tensors by Hugging Face name; errors name the offending tensor."""
        params = dict(self.named_parameters(remove_duplicate=False))
        modules = dict(self.named_modules())
        expected = {n for n in params if not (self.tie_word_embeddings and n == "lm_head.weight")}
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            ours = name[len("model."):] if name.startswith("model.") else name
            if ours == "lm_head.weight" and self.tie_word_embeddings:
                continue
            parts = ours.rsplit(".", 2)  # [module path, proj, weight|bias]
            shard = None
            if len(parts) == 3 and parts[1] in self._FUSED:
                fused, shard = self._FUSED[parts[1]]
                ours = f"{parts[0]}.{fused}.{parts[2]}"
            param = params.get(ours)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in "
                                 f"{type(self).__name__} (architecture {self.hf['architectures'][0]})")
            module = modules[ours.rsplit(".", 1)[0]]
            tensor = tensor.to(param.dtype)
            if shard is not None:
                module.load_shard(param, tensor, shard, name)
            elif hasattr(module, "load_full"):
                module.load_full(param, tensor, name)
            elif isinstance(module, QKVParallelLinear | MergedColumnParallelLinear):
                raise ValueError(f"checkpoint tensor {name!r} must be split into its projections")
            else:
                if param.shape != tensor.shape:
                    raise ValueError(f"tensor {name!r}: checkpoint shape {tuple(tensor.shape)} does "
                                     f"not match the model's {tuple(param.shape)}")
                param.data.copy_(tensor)
            loaded.add(ours if shard is None else f"{ours}#{shard}")
        missing = sorted(n for n in expected if n not in loaded and not _fully_sharded(n, loaded, modules))
        if missing:
            raise ValueError(f"checkpoint is missing tensor(s): {', '.join(missing[:5])}"
                             + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))


def _fully_sharded(name: str, loaded: set[str], modules: dict[str, nn.Module]) -> bool:
    module = modules.get(name.rsplit(".", 1)[0])
    sizes = getattr(module, "out_sizes", None)
    if sizes is None or len(sizes) < 2:
        return False
    return all(f"{name}#{i}" in loaded for i in range(len(sizes)))


class Qwen2ForCausalLM(LlamaForCausalLM):
    def __init__(self, hf: dict[str, Any], backend) -> None:
        super().__init__(hf, backend, qkv_bias=True)


class Qwen3ForCausalLM(LlamaForCausalLM):
    def __init__(self, hf: dict[str, Any], backend) -> None:
        super().__init__(hf, backend, qk_norm=True)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral is Llama with GQA and (v0.1) a sliding window on every layer."""
