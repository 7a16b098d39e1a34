"""Pipeline stages of the shared decoder: each builds and loads only its part, and running the
stages one after another gives the whole model's hidden states (one process, no messages)."""
from __future__ import annotations

import pytest
import torch

from peregrine.attention import get_attention_backend
from peregrine.config import EngineArgs, pipeline_layer_partition
from peregrine.models.protocol import PipelineStage
from peregrine.testing.checkpoints import tiny_checkpoint
from peregrine.testing.steps import one_prefill
from peregrine.worker.loader import load_model


def _model_config(arch: str, layers: int):
    path = str(tiny_checkpoint(arch, num_hidden_layers=layers))
    return EngineArgs(model=path, dtype="float32", device="cpu").create_engine_config().model


@pytest.mark.parametrize("arch,partition", [("llama", (2, 1)), ("qwen3", (1, 2)),
                                            ("llama", (1, 1, 1))])
def test_stages_in_sequence_give_the_whole_models_hidden_states(arch: str, partition) -> None:
    cfg = _model_config(arch, sum(partition))
    backend = get_attention_backend("torch")
    cpu = torch.device("cpu")
    ids = torch.tensor([5, 9, 2, 33, 17, 8, 41])  # (T,)
    pos = torch.arange(ids.numel())  # (T,)
    whole = load_model(cfg, backend, cpu)
    caches, meta = one_prefill(cfg, ids.numel())
    want = whole.compute_logits(whole(ids, pos, caches, meta))  # (T, V)
    x = None
    for rank in range(len(partition)):
        stage = PipelineStage.of(partition, rank)
        model = load_model(cfg, backend, cpu, stage=stage)
        assert len(model.layers) == partition[rank]
        names = {n for n, _ in model.named_parameters()}
        assert any(n.startswith(f"layers.{stage.start_layer}.") for n in names)
        assert not any(n.startswith(f"layers.{i}.") for i in range(cfg.num_layers)
                       if not stage.start_layer <= i < stage.end_layer for n in names)
        assert (hasattr(model, "embed_tokens")) == stage.is_first
        assert (hasattr(model, "lm_head") and hasattr(model, "norm")) == stage.is_last
        caches, meta = one_prefill(cfg, ids.numel())
        caches = caches[:partition[rank]]
        x = model(ids, pos, caches, meta, x) if x is not None else model(ids, pos, caches, meta)
        if not stage.is_last:
            assert x.shape == (2, ids.numel(), cfg.hidden_size)
    torch.testing.assert_close(model.compute_logits(x), want, rtol=0, atol=0)


def test_a_stage_reads_only_its_own_checkpoint_tensors(monkeypatch) -> None:
    cfg = _model_config("qwen3", 3)  # tied embeddings: the last stage's LM head reads them
    read: list[str] = []
    import peregrine.worker.loader as loader
    real = loader.iterate_safetensors

    def spy(model_dir, keep=None):
        for name, t in real(model_dir, keep):
            read.append(name)
            yield name, t

    monkeypatch.setattr(loader, "iterate_safetensors", spy)
    whole = load_model(cfg, get_attention_backend("torch"), torch.device("cpu"))
    read.clear()
    model = load_model(cfg, get_attention_backend("torch"), torch.device("cpu"),
                 stage=PipelineStage.of((2, 1), 1))
    assert read and all(n.startswith("model.layers.2.") or n in ("model.norm.weight",
                                                                 "model.embed_tokens.weight")
                        for n in read)
    torch.testing.assert_close(model.lm_head.weight, whole.embed_tokens.weight)


def test_the_even_split_gives_extra_layers_to_the_stages_before_the_last() -> None:
    assert pipeline_layer_partition(5, 2) == (3, 2)
    assert pipeline_layer_partition(10, 4) == (2, 3, 3, 2)
    assert pipeline_layer_partition(32, 3) == (11, 11, 10)
    assert pipeline_layer_partition(4, 1) == (4,)
    assert pipeline_layer_partition(9, 2, "5,4") == (5, 4)
    assert pipeline_layer_partition(9, 2, "1,8") == (1, 8)
    assert PipelineStage.of((5, 4), 1) == PipelineStage(5, 9, False, True)
    assert PipelineStage.of((9,), 0) == PipelineStage()


@pytest.mark.parametrize("spec,match", [
    ("5", "1 stage\\(s\\) given, pipeline_parallel_size is 2"),
    ("5,x", "expected 2 comma-separated layer counts"),
    ("0,9", "every stage needs at least one layer"),
    ("4,4", "the counts sum to 8, the model has 9 layers"),
])
def test_a_bad_layer_partition_is_refused_with_the_variable_named(spec: str, match: str) -> None:
    with pytest.raises(ValueError, match="PEREGRINE_PP_LAYER_PARTITION.*" + match):
        pipeline_layer_partition(9, 2, spec)


def test_pipeline_settings_are_validated_with_the_flag_named(monkeypatch) -> None:
    path = str(tiny_checkpoint("llama"))  # 2 layers

    def config(**kw):
        return EngineArgs(model=path, device="cpu", **kw).create_engine_config()

    with pytest.raises(ValueError, match="pipeline_parallel_size: 3 stages for the model's 2 "
                                         "layers"):
        config(pipeline_parallel_size=3)
    with pytest.raises(ValueError, match="pipeline_parallel_size: must be >= 1"):
        config(pipeline_parallel_size=0)
    with pytest.raises(ValueError, match="distributed_executor_backend: uni runs one worker"):
        config(pipeline_parallel_size=2, distributed_executor_backend="uni")
    monkeypatch.setenv("PEREGRINE_PP_LAYER_PARTITION", "2,1")
    with pytest.raises(ValueError, match="sum to 3, the model has 2 layers"):
        config(pipeline_parallel_size=2)
    assert config().pp_layer_partition == (2,)  # one stage ignores the variable
    monkeypatch.setenv("PEREGRINE_PP_LAYER_PARTITION", "1,1")
    cfg = config(pipeline_parallel_size=2, tensor_parallel_size=2)
    assert cfg.pp_layer_partition == (1, 1) and cfg.world_size == 4
    assert cfg.distributed_executor_backend == "mp"
    assert cfg.scheduler.max_concurrent_batches == 2


def test_speculative_decoding_with_pipeline_stages_is_refused_by_name() -> None:
    path = str(tiny_checkpoint("llama"))
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    args = EngineArgs(model=path, device="cpu", pipeline_parallel_size=2,
                      speculative_config=ngram)
    with pytest.raises(ValueError, match=r"pipeline_parallel_size: 2 stages do not run with "
                                         r"speculative decoding \(speculative_config is set\)"):
        args.create_engine_config()
    one_stage = EngineArgs(model=path, device="cpu", speculative_config=ngram)
    cfg = one_stage.create_engine_config()
    assert cfg.pipeline_parallel_size == 1 and cfg.speculative.num_speculative_tokens == 3
