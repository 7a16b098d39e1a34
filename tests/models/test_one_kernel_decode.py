"""Which models the one-kernel decode path takes (models/one_kernel_decode.py; its kernel runs
on sm_90+ only): a 4-bit Llama-shaped AWQ model qualifies on the model's side and packs as the
kernel needs, other models and settings are refused with their reason, and without a GPU
nothing is packed."""
from __future__ import annotations

import pytest
import torch

from peregrine.config import EngineArgs
from peregrine.models import one_kernel_decode as okd
from peregrine.testing.checkpoints import tiny_checkpoint
from peregrine.testing.quant_pack import write_quantized_checkpoint

SHAPE = dict(hidden_size=256, head_dim=128, num_attention_heads=4, num_key_value_heads=1,
             intermediate_size=512, num_hidden_layers=2, max_position_embeddings=256)


def _model(path) -> torch.nn.Module:
    from peregrine.attention import get_attention_backend
    from peregrine.worker.loader import load_model
    cfg = EngineArgs(model=str(path), device="cpu", dtype="bfloat16").create_engine_config().model
    return load_model(cfg, get_attention_backend("torch"), torch.device("cpu"))


@pytest.fixture(scope="module")
def awq_llama(tmp_path_factory) -> torch.nn.Module:
    src = tiny_checkpoint("llama", **SHAPE)
    path, _ = write_quantized_checkpoint(src, tmp_path_factory.mktemp("ckpt") / "awq", "awq",
                                         group_size=128)
    return _model(path)


def test_a_4bit_llama_qualifies_and_packs_its_layers(awq_llama) -> None:
    from peregrine.kernels.decode_layers import DecodeLayers, Dims, LayerWeights
    assert okd.unsupported(awq_llama, 16, torch.bfloat16) is None
    layers = [LayerWeights(m.self_attn.qkv_proj.wna16, m.self_attn.o_proj.wna16,
                           m.mlp.gate_up_proj.wna16, m.mlp.down_proj.wna16,
                           m.input_layernorm.weight.data, m.post_attention_layernorm.weight.data)
              for m in awq_llama.layers]
    dims = Dims(256, 4, 1, 128, 512, 16, awq_llama.layers[0].input_layernorm.eps)
    dl = DecodeLayers(dims, layers, awq_llama.norm.weight.data, torch.device("cpu"), splits=4,
                      programs=8)
    w = awq_llama.layers[1].self_attn.o_proj.wna16
    assert torch.equal(dl.unpack(7), w.dequantize(torch.float32).t())  # layer 1's o
    # the engine's caches, one pair a layer
    caches = [(torch.zeros(4, 16, 1, 128, dtype=torch.bfloat16),
               torch.zeros(4, 16, 1, 128, dtype=torch.bfloat16)) for _ in range(2)]
    dl.bind_caches(caches)
    assert dl.table[5, 9] == (caches[1][0].data_ptr() - caches[0][0].data_ptr()) // 2


def test_other_models_and_settings_are_refused_with_their_reason(awq_llama) -> None:
    assert "bf16 only" in okd.unsupported(awq_llama, 16, torch.float8_e4m3fn)
    plain = _model(tiny_checkpoint("llama", **SHAPE))
    assert "not weight-only integer" in okd.unsupported(plain, 16, torch.bfloat16)
    qwen3 = _model(tiny_checkpoint("qwen3"))
    assert "not Llama's layer" in okd.unsupported(qwen3, 16, torch.bfloat16)
    # an embedding that does more than look the row up (the kernel's prologue only looks up)
    from peregrine.layers.embedding import VocabParallelEmbedding
    emb = awq_llama.embed_tokens
    emb.__class__ = type("ScaledEmbedding", (VocabParallelEmbedding,), {})
    try:
        assert "not a plain lookup" in okd.unsupported(awq_llama, 16, torch.bfloat16)
    finally:
        emb.__class__ = VocabParallelEmbedding
    assert okd.unsupported(awq_llama, 16, torch.bfloat16) is None


def test_without_a_gpu_nothing_is_packed(awq_llama) -> None:
    reason = okd.prepare(awq_llama, 16, torch.bfloat16, torch.device("cpu"))
    assert "sm_90+" in reason
    assert getattr(awq_llama, "decode_layers_packed", None) is None
    assert okd.bind(awq_llama, []) == "nothing packed"
    assert awq_llama.decode_layers is None  # the forward keeps the layer-by-layer path


def test_the_start_up_line_names_the_kept_placement_and_each_ones_time() -> None:
    from types import SimpleNamespace
    rows = SimpleNamespace(programs=264, sms=132, stages=4, pre=True,
                           placement_ms={(2, 4, False): 2.0, (2, 4, True): 1.9375,
                                         (1, 8, False): float("inf")})
    line = okd.describe(rows, 32)
    assert "all 32 layers" in line
    assert "264 programs, 2 an SM, a ring of 4, group sums made once" in line
    assert "(2, 4, False): 2.000, (2, 4, True): 1.938, (1, 8, False): inf" in line
    split = SimpleNamespace(programs=132, sms=132, stages=16, placement_ms={(1, 16): 2.1})
    line = okd.describe(split, 32)
    assert "132 programs, 1 an SM, a ring of 16;" in line and "group sums" not in line
