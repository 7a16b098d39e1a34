"""One-row decode steps of a 4-bit Llama-style model through one persistent kernel.

A decode step of one sequence runs every decoder layer in one persistent kernel instead of a
kernel a phase (its prologue looks the token's embedding up), in one of two forms:
`kernels/decode_layers.py` (`split`: each projection's tiles split over the programs) or
`kernels/decode_rows.py` (`rows`: whole-K row tiles, each phase starting on the inputs that
are ready); the final norm and the LM head stay as they are.
`prepare` checks that the model is one the kernel serves and packs its layers (a second copy of
the 4-bit weights, so the memory the KV cache is sized from counts it); `bind` gives the packed
layers the KV caches once they exist and turns the path on (`DecoderForCausalLM.forward` then
takes it for steps of one row). Which models: a whole model on one GPU (no tensor or pipeline
parallelism), Llama's layer (no q/k norms, biases or sliding windows; SiLU), every projection
4-bit weight-only in groups of 128 (AWQ, GPTQ without act-order, compressed-tensors W4A16,
RTN-4), bf16 activations and KV cache, 128-channel heads, four query heads a KV head, on
sm_90+.

The result differs from the layer-by-layer path by the norms' rounding (the kernel rounds
h * weight once where the layer-by-layer path rounds h / rms and then the product), so logits
agree to within bf16 rounding, not bit for bit.
"""
from __future__ import annotations

import torch
from torch import nn

from peregrine.distributed import tp_size


def unsupported(model: nn.Module, block_size: int, cache_dtype: torch.dtype) -> str | None:
    """Why the model's decode steps cannot run in the one kernel (None: they can)."""
    from peregrine.models.decoder import DecoderAttention, DecoderLayer, DecoderMLP
    stage = getattr(model, "stage", None)
    if stage is None or not hasattr(model, "layers"):
        return f"{type(model).__name__} is not a decoder of Llama's form"
    if not (stage.is_first and stage.is_last):
        return "the model is split into pipeline stages"
    if tp_size() != 1:
        return "tensor parallelism"
    from peregrine.layers.embedding import VocabParallelEmbedding
    if type(getattr(model, "embed_tokens", None)) is not VocabParallelEmbedding:
        return "the embedding is not a plain lookup"
    if str(model.hf.get("hidden_act", "silu")) != "silu":
        return f"activation {model.hf.get('hidden_act')!r} (SiLU only)"
    if cache_dtype != torch.bfloat16:
        return f"a {str(cache_dtype).removeprefix('torch.')} KV cache (bf16 only)"
    rope = None
    for i, layer in enumerate(model.layers):
        if (type(layer) is not DecoderLayer or type(layer.self_attn) is not DecoderAttention
                or type(layer.mlp) is not DecoderMLP):
            return f"layer {i} is not Llama's layer"
        attn, mlp = layer.self_attn, layer.mlp
        if attn.attn.sliding_window is not None:
            return f"layer {i} has a sliding window"
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if any(lin.bias is not None for lin in linears):
            return f"layer {i} has biases"
        if any(getattr(lin, "wna16", None) is None for lin in linears):
            return f"layer {i}'s projections are not weight-only integer"
        rope = attn.rotary_emb if rope is None else rope
        if attn.rotary_emb is not rope:
            return "the layers' RoPE tables differ"
        eps = {layer.input_layernorm.eps, layer.post_attention_layernorm.eps, model.norm.eps}
        if len(eps) != 1:
            return "the RMSNorms' eps differ"
    if not len(model.layers):
        return "no layers"
    if block_size < 1:
        return f"block size {block_size}"
    return None


def prepare(model: nn.Module, block_size: int, cache_dtype: torch.dtype,
            device: torch.device, form: str = "split") -> str | None:
    """Pack the model's layers for the one-kernel decode in `form` (see the module docstring);
    the reason why not where it cannot serve them (then nothing changes)."""
    from peregrine.kernels import decode_layers as kd
    if form not in ("split", "rows"):
        raise ValueError(f"one-kernel decode form {form!r}: split or rows")
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (9, 0):
        return "it needs an sm_90+ GPU (TMA, warp specialization)"
    reason = unsupported(model, block_size, cache_dtype)
    if reason is not None:
        return reason
    first = model.layers[0]
    attn = first.self_attn
    dims = kd.Dims(hidden=model.hf["hidden_size"], heads=attn.num_heads,
                   kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
                   inter=first.mlp.down_proj.wna16.in_features, block_size=block_size,
                   eps=first.input_layernorm.eps)
    layers = [kd.LayerWeights(layer.self_attn.qkv_proj.wna16, layer.self_attn.o_proj.wna16,
                              layer.mlp.gate_up_proj.wna16, layer.mlp.down_proj.wna16,
                              layer.input_layernorm.weight.data,
                              layer.post_attention_layernorm.weight.data)
              for layer in model.layers]
    programs = torch.cuda.get_device_properties(device).multi_processor_count
    splits = kd.attention_splits(programs, dims.kv_heads)
    if form == "rows":
        from peregrine.kernels import decode_rows as kr
        check, cls = kr.unsupported, kr.DecodeRows
    else:
        check, cls = kd.unsupported, kd.DecodeLayers
    reason = check(dims, layers, layers[0].qkv.scales.dtype, programs=programs, splits=splits)
    if reason is not None:
        return reason
    model.decode_layers_packed = cls(dims, layers, model.norm.weight.data, device,
                                     programs=programs, splits=splits)
    return None


def bind(model: nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> str | None:
    """Give the packed layers (if any) the KV caches, compile and run the kernel on a padding
    row (position 0, slot -1: it stores no K/V), keep the fastest of its placements
    (`choose_placement`; each one's ms a step in `placement_ms`), and turn the path on. None
    when it is on, else why not (nothing packed, or the kernel failed: the layer-by-layer path
    stays)."""
    dl = getattr(model, "decode_layers_packed", None)
    if dl is None:
        return "nothing packed"
    try:
        dl.bind_caches([(k, v) for k, v in kv_caches])
        dev = dl.vec.device
        x = torch.zeros(1, dl.dims.hidden, dtype=torch.bfloat16, device=dev)
        cos_sin = model.layers[0].self_attn.rotary_emb.cos_sin_cache
        pos = torch.zeros(1, dtype=torch.int64, device=dev)
        slot = torch.full((1,), -1, dtype=torch.int64, device=dev)
        table = torch.zeros(1, 1, dtype=torch.int32, device=dev)
        dl(x, pos, slot, table, cos_sin)
        torch.cuda.synchronize(dev)
        # the placement (the kernel module's PLACEMENTS) that runs this GPU's step fastest
        dl.placement_ms = dl.choose_placement(lambda: dl(x, pos, slot, table, cos_sin))
    except Exception as e:  # noqa: BLE001 - any failure keeps the layer-by-layer path
        del model.decode_layers_packed
        return f"{type(e).__name__}: {e}"
    model.decode_layers = dl
    return None


def describe(dl, layers: int) -> str:
    """What the start-up line says of a bound kernel: its placement and how long a step took
    in each placement it timed."""
    timed = ", ".join(f"{form}: {ms:.3f}" for form, ms in dl.placement_ms.items())
    pairs = ", group sums made once" if getattr(dl, "pre", False) else ""
    return (f"decode steps of one sequence run all {layers} layers in one kernel "
            f"({dl.programs} programs, {dl.programs // dl.sms} an SM, a ring of {dl.stages}"
            f"{pairs}; ms a step by placement: {timed})")


def run(model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
        slot_mapping: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """The final-normed hidden state (1, hidden) of a one-row decode step (the kernel's
    prologue reads the token's embedding row itself)."""
    cos_sin = model.layers[0].self_attn.rotary_emb.cos_sin_cache
    h = model.decode_layers(model.embed_tokens.weight, positions, slot_mapping, block_table,
                            cos_sin, token=input_ids)
    return model.norm(h)
