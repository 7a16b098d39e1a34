"""Models by Hugging Face id: fetched through huggingface_hub, or found in its local cache offline."""
from __future__ import annotations

import shutil
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub import constants

from peregrine import LLM, SamplingParams
from peregrine.hub import ALLOW_PATTERNS, is_repo_id, resolve_model_path
from peregrine.testing.checkpoints import tiny_checkpoint


def test_a_hub_id_is_fetched_with_revision_cache_dir_and_only_what_the_engine_reads(
        monkeypatch, tmp_path) -> None:
    calls: list[dict] = []
    local = tiny_checkpoint("llama")

    def fake_snapshot(repo_id: str, **kw) -> str:  # the boundary: no network in tests
        calls.append({"repo_id": repo_id, **kw})
        return str(local)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot)
    llm = LLM("org/tiny-llama", revision="v1", download_dir=str(tmp_path), dtype="float32",
              device="cpu", max_model_len=64)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3
    assert llm.engine.config.model.served_model_name == "org/tiny-llama"
    call = calls[0]
    assert (call["repo_id"], call["revision"], call["cache_dir"]) == ("org/tiny-llama", "v1",
                                                                      str(tmp_path))
    assert "*.safetensors" in call["allow_patterns"] and "*.bin" not in call["allow_patterns"]


def _cached_snapshot(cache: Path, repo_id: str, files_from: Path, sha: str = "a" * 40) -> Path:
    """The Hugging Face cache layout: models--org--name/{refs/main, snapshots/<sha>/...}."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / sha
    snap.mkdir(parents=True)
    for f in files_from.iterdir():
        shutil.copy(f, snap / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(sha)
    return snap


def test_offline_the_local_cache_is_used(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    snap = _cached_snapshot(tmp_path, "org/cached", Path(tiny_checkpoint("qwen3")))
    assert Path(resolve_model_path("org/cached", download_dir=str(tmp_path))) == snap


def test_an_unreachable_hub_says_so_and_names_the_way_out(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # as with no network: nothing cached
    with pytest.raises(ValueError, match="could not be reached.*local model folder") as info:
        resolve_model_path("org/not-cached", download_dir=str(tmp_path))
    assert "\n" not in str(info.value)


def test_a_tokenizer_id_is_resolved_too(monkeypatch) -> None:
    local = tiny_checkpoint("llama")
    seen: list[str] = []

    def fake_snapshot(repo_id: str, **kw) -> str:
        seen.append(repo_id)
        return str(local)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot)
    from peregrine.config import EngineArgs
    cfg = EngineArgs(model=str(local), tokenizer="org/tok").create_engine_config()
    assert seen == ["org/tok"] and cfg.model.tokenizer == str(local)


@pytest.mark.parametrize("name,expected", [("Qwen/Qwen3-0.6B", True), ("gpt2", True),
                                           ("a/b/c", False), ("../up", False), ("/abs/dir", False),
                                           ("org/na me", False)])
def test_what_counts_as_a_hub_id(name: str, expected: bool) -> None:
    assert is_repo_id(name) is expected


def test_allow_patterns_take_no_pickle_weights() -> None:
    assert not any(p.endswith((".bin", ".pt", ".pth")) for p in ALLOW_PATTERNS)


def test_the_built_in_models_by_name(monkeypatch, tmp_path) -> None:
    from peregrine.demo import demo_draft_path, demo_model_path

    def no_hub(*a, **kw):  # a built-in name never reaches the Hub
        raise AssertionError("the Hub was asked")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_hub)
    assert Path(resolve_model_path("peregrine-demo")) == demo_model_path()
    assert Path(resolve_model_path("peregrine-demo-draft")) == demo_draft_path()
    # the name the server lists the demo model under loads it, and a draft by name speculates
    llm = LLM("peregrine-demo", device="cpu", dtype="float32", max_model_len=64,
              speculative_config={"model": "peregrine-demo-draft", "num_speculative_tokens": 2})
    assert llm.engine.config.model.served_model_name == "peregrine-demo"
    assert Path(llm.engine.config.model.model) == demo_model_path()
    spec = llm.engine.config.speculative
    assert spec.method == "draft_model" and Path(spec.draft.model) == demo_draft_path()
    out = llm.generate(["def f"], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    # a local folder of that name comes first
    folder = tmp_path / "peregrine-demo"
    folder.mkdir()
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("peregrine-demo") == "peregrine-demo"
