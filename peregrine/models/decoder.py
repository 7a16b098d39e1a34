"""The shared pre-norm decoder-only transformer (attention, gated MLP, causal LM, checkpoint
loading). A family file subclasses `DecoderForCausalLM` and swaps parts or overrides hooks:
`parts` (attention / MLP / norm classes), `layer_windows`, `rotary_embeddings`."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

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
from peregrine.models.protocol import BuildOptions, KVCache, final_norm, stage_output


def head_dim_of(hf: dict[str, Any]) -> int:
    return int(hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])


def _eps(hf: dict[str, Any]) -> float:
    return hf.get("rms_norm_eps", 1e-6)


# Whether a layer's linears may take the RMSNorms between them into their kernels where the
# quantization method has such kernels (the row-parallel linear before a norm adds the residual,
# the column-parallel one after it normalises its input: QuantMethod.apply_add /
# apply_rms_normed): two launches fewer per layer at a decode batch those kernels serve.
FUSE_NORMS = True
# Whether, with the norms taken in, the gate/up linear's kernel may also write the activation
# silu(gate) * up (QuantMethod.apply_rms_normed_silu_and_mul), so that the down projection reads
# I inputs, not the 2I it would otherwise activate as it reads them. H200, Llama-3-8B, one FP8
# row: the down projection 16.0 against 17.3 us a call, gate/up unchanged; batch-1 decode 419.8
# against 412.3 tok/s (INT8 W8A8 403.6 against 396.7).
FUSE_ACTIVATION = True


class DecoderAttention(nn.Module):
    """qkv projection, RoPE, paged attention, output projection (Llama's layout)."""

    def __init__(self, hf: dict[str, Any], rope: RotaryEmbedding, opts: BuildOptions, prefix: str,
                 window: int | None = None) -> None:
        super().__init__()
        hidden = hf["hidden_size"]
        heads = hf["num_attention_heads"]
        kv_heads = hf.get("num_key_value_heads") or heads
        head_dim = head_dim_of(hf)
        self.num_heads = divide(heads, tp_size(), "num_attention_heads")
        self.num_kv_heads = divide(kv_heads, tp_size(), "num_key_value_heads")
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        linear = dict(dtype=opts.dtype, quant_config=opts.quant_config)
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, heads, kv_heads,
                                          bias=self.qkv_bias(hf), prefix=f"{prefix}.qkv_proj",
                                          **linear)
        self.o_proj = RowParallelLinear(heads * head_dim, hidden, bias=self.o_bias(hf),
                                        prefix=f"{prefix}.o_proj", **linear)
        self.rotary_emb = rope
        # NOTE: with fused kernels, q/k norm, RoPE and the K/V store are one launch
        # (kernels/rope_store.py); chosen here, once.
        self.use_fused = opts.kernels.fused
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim, head_dim ** -0.5,
                              opts.backend, sliding_window=window)

    @staticmethod
    def qkv_bias(hf: dict[str, Any]) -> bool:
        return bool(hf.get("attention_bias", False))

    @staticmethod
    def o_bias(hf: dict[str, Any]) -> bool:
        return bool(hf.get("attention_bias", False))

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head q/k normalisation before RoPE (none here; Qwen3 overrides this and
        qk_norm_params, which the fused kernel reads)."""
        return q, k

    def qk_norm_params(self) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        """(q weight, k weight, eps) of the per-head q/k RMSNorm, None without one."""
        return None

    def project(self, positions: torch.Tensor, x: torch.Tensor,
                qkv: torch.Tensor | None = None):
        """q (T, Hq, D), k and v (T, Hkv, D) of x (T, hidden), with q/k norm and RoPE applied
        (qkv: the projection of x when already computed)."""
        t = x.shape[0]
        if qkv is None:
            qkv = self.qkv_proj(x)  # (T, q_size + 2 kv_size)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)  # (T, Hq, D)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        q, k = self.qk_norm(q, k)
        q, k = self.rotary_emb(positions, q, k)
        return q, k, v.reshape(t, self.num_kv_heads, self.head_dim)

    def project_and_store(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: KVCache,
                          slot_mapping: torch.Tensor, q_out: torch.Tensor | None = None,
                          norm: nn.Module | None = None) -> torch.Tensor:
        """q (T, Hq, D) of x (T, hidden) with q/k norm and RoPE applied (written into q_out
        when given); this step's K/V written into kv_cache at slot_mapping (T,) (-1 writes
        nothing). With `norm`, x is the residual stream and the projection's input norm(x),
        inside the qkv kernel where its method has one."""
        qkv = None
        if norm is not None:
            qkv = self.qkv_proj.forward_normed(x, norm) if FUSE_NORMS else None
            if qkv is None:
                x = norm(x)
        if not self.use_fused:
            q, k, v = self.project(positions, x, qkv)
            self.attn.store(k, v, kv_cache, slot_mapping)
            return q if q_out is None else q_out.copy_(q)
        from peregrine.kernels.rope_store import norm_rope_store
        t = x.shape[0]
        if qkv is None:
            qkv = self.qkv_proj(x)  # (T, q_size + 2 kv_size)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)  # (T, Hq, D), a view into qkv
        k = k.view(t, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        v = v.view(t, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        norm = self.qk_norm_params()
        q_weight, k_weight, eps = norm if norm is not None else (None, None, 1e-6)
        k_scale, v_scale = self.attn.cache_scales(kv_cache[0])
        # NOTE: the output projection is what runs after attention; its method says whether
        # the kernels of attention may be scheduled early (rope_store's release).
        return norm_rope_store(q, k, v, positions, self.rotary_emb.cos_sin_cache, kv_cache[0],
                               kv_cache[1], slot_mapping, k_scale, v_scale, q_weight, k_weight,
                               eps, q_out,
                               gemv_projections=self.o_proj.quant_method.dependent_launches)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        q = self.project_and_store(positions, x, kv_cache, meta.slot_mapping)
        return self.o_proj(self.attn(q, None, None, kv_cache, meta))  # (T, hidden)


class DecoderMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up in one GEMM."""

    def __init__(self, hf: dict[str, Any], opts: BuildOptions, prefix: str) -> None:
        super().__init__()
        hidden, inter = hf["hidden_size"], hf["intermediate_size"]
        bias = bool(hf.get("mlp_bias", False))
        linear = dict(dtype=opts.dtype, quant_config=opts.quant_config)
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden, [inter, inter], bias=bias, prefix=f"{prefix}.gate_up_proj",
            shard_names=("gate_proj", "up_proj"), **linear)
        self.down_proj = RowParallelLinear(inter, hidden, bias=bias, prefix=f"{prefix}.down_proj",
                                           **linear)
        self.act = SiluAndMul(fused=opts.kernels.fused)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.gate_up_proj(x))  # (T, hidden)

    def down(self, h: torch.Tensor) -> torch.Tensor:
        """The down projection of the activation of gate-and-up rows h (T, 2I)."""
        if self.act.use_fused:  # the down projection's own kernel may take the activation
            y = self.down_proj.forward_silu_and_mul(h)
            if y is not None:
                return y  # (T, hidden)
        return self.down_proj(self.act(h))  # (T, hidden)

    def forward_from_stream(self, residual: torch.Tensor, norm: nn.Module
                            ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(forward(norm(residual)), residual) for rows of the residual stream (T, hidden),
        where the linears' kernels may take the norm (gate/up) and the next residual add
        (down): then (None, residual + the MLP's output)."""
        if self.act.use_fused and FUSE_ACTIVATION:  # gate/up's kernel: norm and activation
            a = self.gate_up_proj.forward_normed_silu_and_mul(residual, norm)  # (T, I)
            if a is not None:
                y = self.down_proj.forward_add(a, residual)
                return (None, y) if y is not None else (self.down_proj(a), residual)
        h = self.gate_up_proj.forward_normed(residual, norm)
        if h is None:
            h = self.gate_up_proj(norm(residual))  # (T, 2I)
        if self.act.use_fused:
            y = self.down_proj.forward_silu_and_mul_add(h, residual)
            if y is not None:
                return None, y
            return self.down(h), residual
        a = self.act(h)  # (T, I)
        y = self.down_proj.forward_add(a, residual)
        if y is not None:
            return None, y
        return self.down_proj(a), residual


class DecoderParts(NamedTuple):
    """The module classes a family builds its layers from."""

    attention: type[nn.Module] = DecoderAttention
    mlp: type[nn.Module] = DecoderMLP
    norm: type[nn.Module] = RMSNorm  # norm(hidden, eps, dtype=, fused=)


class DecoderLayer(nn.Module):
    def __init__(self, hf: dict[str, Any], rope: RotaryEmbedding, opts: BuildOptions,
                 prefix: str, window: int | None, parts: DecoderParts) -> None:
        super().__init__()
        hidden = hf["hidden_size"]
        norm = dict(dtype=opts.dtype, fused=opts.kernels.fused)
        self.self_attn = parts.attention(hf, rope, opts, f"{prefix}.self_attn", window)
        self.mlp = parts.mlp(hf, opts, f"{prefix}.mlp")
        self.input_layernorm = parts.norm(hidden, _eps(hf), **norm)
        self.post_attention_layernorm = parts.norm(hidden, _eps(hf), **norm)

    def forward(self, positions, x, residual, kv_cache, meta):
        q, residual = self.pre_attention(positions, x, residual, kv_cache, meta.slot_mapping)
        return self.post_attention(self.self_attn.attn(q, None, None, kv_cache, meta), residual)

    # NOTE: the halves around attention are what piecewise CUDA graphs capture (cuda_graphs.py).
    def pre_attention(self, positions: torch.Tensor, x: torch.Tensor,
                      residual: torch.Tensor | None, kv_cache: KVCache,
                      slot_mapping: torch.Tensor,
                      out: tuple[torch.Tensor, torch.Tensor] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Input norm (residual add included), q/k/v with this step's K/V stored: (q, residual),
        written into out = (q (T, Hq, D), residual (T, hidden)) buffers when given. x is None
        where the layer before added its output into `residual` already (post_attention)."""
        q_out, res_out = (None, None) if out is None else out
        if residual is None or x is None:  # the residual stream is x, or residual, as it is
            stream = x if residual is None else residual
            residual = stream if res_out is None else res_out.copy_(stream)
            q = self.self_attn.project_and_store(positions, residual, kv_cache, slot_mapping,
                                                 q_out, norm=self.input_layernorm)
            return q, residual
        x, residual = self.input_layernorm(x, residual, residual_out=res_out)
        q = self.self_attn.project_and_store(positions, x, kv_cache, slot_mapping, q_out)
        return q, residual

    def post_attention(self, attn_out: torch.Tensor, residual: torch.Tensor
                       ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Output projection, residual add and norm, MLP: (x, residual) for the next layer; x
        is None where the MLP's down projection added it into residual itself (the linears'
        kernels taking the norms, FUSE_NORMS)."""
        o_proj = self.self_attn.o_proj
        stream = o_proj.forward_add(attn_out, residual) if FUSE_NORMS else None
        if stream is not None and hasattr(self.mlp, "forward_from_stream"):
            return self.mlp.forward_from_stream(stream, self.post_attention_layernorm)
        if stream is not None:  # an MLP of another shape: its input norm as a kernel
            return self.mlp(self.post_attention_layernorm(stream)), stream
        x, residual = self.post_attention_layernorm(o_proj(attn_out), residual)
        return self.mlp(x), residual


class StageLayers(nn.Module):
    """A pipeline stage's decoder layers: registered under their model-wide index (parameter
    names stay `layers.{i}...` as in the checkpoint), indexed from 0 like a list."""

    def __init__(self, start: int, layers: list[nn.Module]) -> None:
        super().__init__()
        self.start = start
        for i, layer in enumerate(layers):
            self.add_module(str(start + i), layer)

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())

    def __getitem__(self, i):
        return list(self._modules.values())[i]


class DecoderForCausalLM(nn.Module):
    """Embedding, decoder layers, final norm and LM head (tied to the embedding when asked); a
    pipeline stage (`BuildOptions.stage`) builds and loads only its own part."""

    parts = DecoderParts()
    # One-row decode steps through one persistent kernel (models/one_kernel_decode.py): set
    # when the worker turned it on.
    decode_layers = None

    def __init__(self, hf: dict[str, Any], opts: BuildOptions) -> None:
        super().__init__()
        self.hf = hf
        hidden = hf["hidden_size"]
        n = hf["num_hidden_layers"]
        stage = opts.stage
        start, end = stage.start_layer, n if stage.end_layer is None else stage.end_layer
        if not 0 <= start < end <= n:
            raise ValueError(f"pipeline stage layers [{start}, {end}) are not within the "
                             f"model's {n} layers")
        self.stage, self.start_layer, self.end_layer = stage, start, end
        self.tie_word_embeddings = bool(hf.get("tie_word_embeddings", False))
        if stage.is_first:
            self.embed_tokens = VocabParallelEmbedding(hf["vocab_size"], hidden, dtype=opts.dtype)
        ropes = self.rotary_embeddings(hf, opts)
        windows = self.layer_windows(hf)
        self.layers = StageLayers(start, [
            DecoderLayer(hf, ropes[i], opts, f"model.layers.{i}", windows[i], self.parts)
            for i in range(start, end)])
        if stage.is_last:
            self.norm = self.parts.norm(hidden, _eps(hf), dtype=opts.dtype,
                                        fused=opts.kernels.fused)
            self.lm_head = ParallelLMHead(hf["vocab_size"], hidden, dtype=opts.dtype)
            if self.tie_word_embeddings and stage.is_first:
                self.lm_head.weight = self.embed_tokens.weight

    @classmethod
    def rotary_embeddings(cls, hf: dict[str, Any], opts: BuildOptions) -> list[RotaryEmbedding]:
        """Each layer's RoPE: one table shared by every layer here."""
        theta, scaling = rope_parameters(hf)
        max_pos = int(hf.get("max_position_embeddings") or 2048)
        rope = RotaryEmbedding(head_dim_of(hf), max_pos, theta, scaling, fused=opts.kernels.fused)
        return [rope] * hf["num_hidden_layers"]

    @classmethod
    def layer_windows(cls, hf: dict[str, Any]) -> list[int | None]:
        """Each layer's sliding window (None: full attention), as transformers reads config.json:
        `layer_types` when present, else the family's rule (`default_windows`)."""
        n = hf["num_hidden_layers"]
        window = hf.get("sliding_window")
        if not window:
            return [None] * n
        types = hf.get("layer_types")
        if types:
            if len(types) != n:
                raise ValueError(f"config.json: layer_types has {len(types)} entries for {n} "
                                 "layers")
            return [int(window) if t == "sliding_attention" else None for t in types]
        return cls.default_windows(hf, int(window), n)

    @classmethod
    def default_windows(cls, hf: dict[str, Any], window: int, n: int) -> list[int | None]:
        """Windows without `layer_types`: none (Llama ignores sliding_window)."""
        return [None] * n

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata, intermediate: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states (T, hidden) for the flat step batch; a stage but the last returns
        (2, T, hidden) = (hidden, residual) for the next stage, one but the first starts from
        the previous stage's."""
        if self.decode_layers is not None and input_ids.shape[0] == 1 and meta.num_decodes == 1:
            from peregrine.models.one_kernel_decode import run
            return run(self, input_ids, positions, meta.slot_mapping, meta.block_table)
        if self.stage.is_first:
            x, residual = self.embed_tokens(input_ids), None  # (T, hidden)
        else:
            if intermediate is None:
                raise ValueError("a pipeline stage after the first needs the previous stage's "
                                 "hidden states and residual")
            x, residual = intermediate[0], intermediate[1]  # (T, hidden) each
        for layer, cache in zip(self.layers, kv_caches):
            x, residual = layer(positions, x, residual, cache, meta)
        if not self.stage.is_last:
            return stage_output(x, residual)  # (2, T, hidden)
        return final_norm(self.norm, x, residual)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None
                       ) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden, out)  # (N, V) float32

    def skip_checkpoint_tensor(self, name: str) -> bool:
        """Tensors the checkpoint may hold that the model does not load."""
        return "rotary_emb.inv_freq" in name or (
            self.tie_word_embeddings and name == "lm_head.weight")

    def owns_checkpoint_tensor(self, name: str) -> bool:
        """False for a tensor of another pipeline stage's part (the loader never reads it)."""
        ours = name[len("model."):] if name.startswith("model.") else name
        if ours.startswith("layers."):
            index = ours.split(".", 2)[1]
            return not index.isdigit() or self.start_layer <= int(index) < self.end_layer
        if ours.startswith("embed_tokens."):
            return self.stage.is_first or (self.stage.is_last and self.tie_word_embeddings)
        if ours.startswith(("norm.", "lm_head.")):
            return self.stage.is_last
        return True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load checkpoint tensors by Hugging Face name; errors name the offending tensor."""
        params = dict(self.named_parameters(remove_duplicate=False))
        modules = dict(self.named_modules())
        # checkpoint module (e.g. layers.0.self_attn.k_proj) -> (merged module, shard index)
        merged = {f"{path.rpartition('.')[0]}.{s}": (path, i) for path, m in modules.items()
                  for i, s in enumerate(getattr(m, "shard_names", ()))}
        # NOTE: a tied LM head on a last stage without the embedding loads the embedding tensor.
        head_from_embedding = (self.tie_word_embeddings and self.stage.is_last
                               and not self.stage.is_first)
        expected = {n for n in params if not (self.tie_word_embeddings and n == "lm_head.weight")
                    or head_from_embedding}
        loaded: set[str] = set()
        for name, tensor in weights:
            if self.skip_checkpoint_tensor(name) or not self.owns_checkpoint_tensor(name):
                continue
            ours = name[len("model."):] if name.startswith("model.") else name
            if head_from_embedding and ours == "embed_tokens.weight":
                ours = "lm_head.weight"
            path, _, leaf = ours.rpartition(".")
            path, shard = merged.get(path, (path, None))
            key = f"{path}.{leaf}"
            param = params.get(key)
            if param is None:
                arch = self.hf["architectures"][0]
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in "
                                 f"{type(self).__name__} (architecture {arch})")
            module = modules[path]
            if hasattr(module, "weight_loader"):
                module.weight_loader(param, tensor, shard, name)
            elif hasattr(module, "load_full"):
                module.load_full(param, tensor, name)
            else:
                if param.shape != tensor.shape:
                    raise ValueError(f"tensor {name!r}: checkpoint shape {tuple(tensor.shape)} "
                                     f"does not match the model's {tuple(param.shape)}")
                param.data.copy_(tensor)
            loaded.add(key if shard is None else f"{key}#{shard}")
        missing = sorted(n for n in expected if n not in loaded
                         and not _all_shards_loaded(n, loaded, modules))
        if missing:
            raise ValueError(f"checkpoint is missing tensor(s): {', '.join(missing[:5])}"
                             + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))


def _all_shards_loaded(name: str, loaded: set[str], modules: dict[str, nn.Module]) -> bool:
    shards = getattr(modules.get(name.rpartition(".")[0]), "shard_names", ())
    return bool(shards) and all(f"{name}#{i}" in loaded for i in range(len(shards)))
