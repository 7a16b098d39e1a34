"""speculative_config: vLLM's keys resolve to a validated SpeculativeConfig; bad ones are refused
naming the field; the CLI takes it as JSON."""
from __future__ import annotations

import json

import pytest

from peregrine.config import EngineArgs
from peregrine.demo import demo_draft_path
from peregrine.spec_decode import get_proposer_class
from peregrine.spec_decode.config import DEFAULT_DISABLE_BY_BATCH_SIZE
from peregrine.testing.checkpoints import tiny_checkpoint

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}


def _config(spec, **kw):
    args = EngineArgs(model=str(tiny_checkpoint("llama")), device="cpu", speculative_config=spec,
                      **kw)
    return args.create_engine_config()


def test_ngram_config_resolves_and_keeps_async_scheduling() -> None:
    cfg = _config(NGRAM, async_scheduling=True)
    spec = cfg.speculative
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max,
            spec.prompt_lookup_min) == ("ngram", 4, 4, 2)
    assert spec.disable_by_batch_size == DEFAULT_DISABLE_BY_BATCH_SIZE
    assert cfg.async_scheduling is True
    assert _config(None).speculative is None


def test_json_text_is_accepted_as_on_the_cli() -> None:
    spec = _config(json.dumps({**NGRAM, "disable_by_batch_size": None})).speculative
    assert spec.num_speculative_tokens == 4 and spec.disable_by_batch_size is None


def test_model_without_method_means_a_draft_model() -> None:
    cfg = _config({"model": str(tiny_checkpoint("llama")), "num_speculative_tokens": 3,
                   "quantization": "rtn"})
    spec = cfg.speculative
    assert spec.method == "draft_model" and spec.quantization == "rtn"
    assert spec.draft is not None and spec.draft.vocab_size == cfg.model.vocab_size
    assert spec.draft.dtype == cfg.model.dtype


@pytest.mark.parametrize("spec, match", [
    ({**NGRAM, "num_speculative_tokens": 0}, r"speculative_config\.num_speculative_tokens"),
    ({"method": "ngram"}, r"speculative_config\.num_speculative_tokens: missing"),
    ({**NGRAM, "method": "medusa"}, r"speculative_config\.method: 'medusa'"),
    ({"num_speculative_tokens": 2}, r"speculative_config\.method: missing"),
    ({**NGRAM, "lookahead": 3}, r"unknown key\(s\) lookahead"),
    ({**NGRAM, "prompt_lookup_min": 5}, r"speculative_config\.prompt_lookup_min: 5 > "
                                        r"prompt_lookup_max 4"),
    ({**NGRAM, "prompt_lookup_min": 0}, r"prompt_lookup_min: must be >= 1"),
    ({**NGRAM, "num_speculative_tokens": "4"}, r"num_speculative_tokens: expected an integer"),
    ({**NGRAM, "disable_by_batch_size": 0}, r"disable_by_batch_size: must be >= 1"),
    ({**NGRAM, "quantization": "fp8"}, r"speculative_config\.quantization: only a draft_model"),
    ({"model": "/nonexistent/draft", "num_speculative_tokens": 2}, r"speculative_config\.model"),
    ("{not json", r"speculative_config: not JSON"),
    ([1, 2], r"speculative_config: expected a JSON object"),
])
def test_bad_configs_are_refused_naming_the_field(spec, match) -> None:
    with pytest.raises(ValueError, match=match):
        _config(spec)


def test_a_draft_with_another_vocabulary_is_refused() -> None:
    other = tiny_checkpoint("llama", with_tokenizer=False, vocab_size=300)
    with pytest.raises(ValueError, match=r"speculative_config\.model: the draft's vocab_size 300"):
        _config({"model": str(other), "num_speculative_tokens": 2})


def test_unknown_draft_quantization_is_refused() -> None:
    with pytest.raises(ValueError, match=r"speculative_config\.quantization: unknown"):
        _config({"model": str(demo_draft_path()), "num_speculative_tokens": 2,
                 "quantization": "int3"})


def test_unsupported_combinations_are_refused() -> None:
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        _config(NGRAM, pipeline_parallel_size=2)


def test_proposer_registry_resolves_methods_and_refuses_unknown_ones() -> None:
    assert get_proposer_class("ngram").__name__ == "NgramProposer"
    with pytest.raises(ValueError, match="unknown speculative method 'eagle'"):
        get_proposer_class("eagle")


def test_cli_flag_takes_json() -> None:
    import argparse

    from peregrine.entrypoints.cli import add_engine_args, engine_args_from
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns = parser.parse_args(["--model", str(tiny_checkpoint("llama")), "--device", "cpu",
                            "--speculative-config", json.dumps(NGRAM)])
    cfg = engine_args_from(ns).create_engine_config()
    assert cfg.speculative.prompt_lookup_min == 2
