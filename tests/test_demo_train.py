"""The demo model's recipe (peregrine.demo.corpus / evaluate / train) on tiny CPU settings."""
from __future__ import annotations

import hashlib
import json
import math
import shutil
import tarfile
from pathlib import Path

import pytest
import torch

from peregrine.demo import corpus
from peregrine.demo.evaluate import (eval_windows, model_cross_entropy, unigram_cross_entropy,
                                     unigram_log_probs)
from peregrine.demo.tokenizer import train_bpe_json
from peregrine.demo.train import batch_starts, lr_at, main, parse_args

# Real stdlib modules copied into a fake stdlib: the held-out and validation ones, and a few more.
_KEEP = (*corpus.HELD_OUT_MODULES, *corpus.VALIDATION_MODULES, "colorsys.py", "keyword.py",
         "glob.py", "fnmatch.py", "sched.py")
_TINY_FLAGS = ["--device", "cpu", "--vocab-size", "300", "--seq-len", "32", "--batch-size", "4",
               "--max-steps", "3", "--eval-every", "2", "--max-eval-tokens", "400",
               "--hidden-size", "32", "--num-hidden-layers", "1", "--num-attention-heads", "2",
               "--num-key-value-heads", "1", "--intermediate-size", "64",
               "--draft-hidden-size", "32", "--draft-num-hidden-layers", "1",
               "--draft-num-attention-heads", "2", "--draft-num-key-value-heads", "1",
               "--draft-intermediate-size", "32"]


@pytest.fixture(scope="module")
def fake_stdlib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("stdlib")
    real = corpus.stdlib_root()
    for name in _KEEP:
        src = real / name
        if src.is_dir():
            shutil.copytree(src, root / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(src, root / name)
    # Files the corpus must skip.
    for rel in ("test/test_glob.py", "site-packages/pkg/mod.py", "json/tests/test_x.py",
                "idlelib/idle_test/t.py", "config-3.11-x86_64-linux-gnu/python-config.py",
                "pydoc_data/topics.py"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("x = 1\n")
    (root / "encodings").mkdir()
    (root / "encodings" / "cp999.py").write_text('""" Python Character Mapping Codec cp999 '
                                                 "generated from 'X.TXT' with gencodec.py.\n\"\"\"\n")
    (root / "encodings" / "__init__.py").write_text("def search_function(name):\n    return None\n")
    (root / "_sysconfigdata__linux.py").write_text("build_time_vars = {}\n")
    (root / "huge.py").write_text("x = 1\n" * (corpus.MAX_FILE_BYTES // 6 + 1))
    (root / "latin1.py").write_bytes(b"s = '\xe9'\n")
    return root


def test_corpus_skips_tests_installed_packages_and_generated_files(fake_stdlib: Path) -> None:
    files, excluded = corpus.collect_sources(fake_stdlib)
    rels = [f.rel for f in files]
    assert rels == sorted(rels)
    assert "encodings/__init__.py" in rels and "json/decoder.py" in rels
    for bad in ("test/", "site-packages/", "json/tests/", "idle_test/", "config-", "pydoc_data/",
                "cp999", "_sysconfigdata", "huge.py", "latin1.py"):
        assert not any(bad in r for r in rels), bad
    assert excluded == {"excluded folder": 6, "too large": 1, "generated": 2, "not utf-8": 1}


def test_split_holds_out_whole_modules(fake_stdlib: Path) -> None:
    split = corpus.load_split(fake_stdlib)
    held = {f.module for f in split.held_out}
    assert held == set(corpus.HELD_OUT_MODULES)
    assert {f.module for f in split.validation} == set(corpus.VALIDATION_MODULES)
    assert not held & {f.module for f in split.train}
    assert "json/__init__.py" in [f.rel for f in split.held_out]


def test_split_names_a_missing_held_out_module(fake_stdlib: Path) -> None:
    files, _ = corpus.collect_sources(fake_stdlib)
    with pytest.raises(ValueError, match="'csv.py'"):
        corpus.split_sources([f for f in files if f.module != "csv.py"])


def test_this_pythons_stdlib_has_the_held_out_modules() -> None:
    split = corpus.load_split()
    assert {f.module for f in split.held_out} == set(corpus.HELD_OUT_MODULES)
    assert len(split.train) > 300
    assert not any("/test/" in f"/{f.rel}" or "site-packages" in f.rel for f in split.train)


def test_eval_windows_predict_every_token_once() -> None:
    stream = torch.arange(10)
    windows = eval_windows(stream, 4)
    targets = torch.cat([w[1:] for w in windows])
    assert targets.tolist() == list(range(1, 10))
    assert [w.numel() for w in windows] == [5, 5, 2]
    with pytest.raises(ValueError, match="seq_len"):
        eval_windows(stream, 0)


def test_unigram_is_add_one_smoothed_counts() -> None:
    train = torch.tensor([0, 1, 1, 1])
    lp = unigram_log_probs(train, vocab_size=3)
    assert torch.allclose(lp.exp(), torch.tensor([2 / 7, 4 / 7, 1 / 7], dtype=torch.float64))
    # The first token of the stream is context, not predicted.
    ce = unigram_cross_entropy(lp, torch.tensor([2, 1, 2]))
    assert math.isclose(ce, -(math.log(4 / 7) + math.log(1 / 7)) / 2)
    with pytest.raises(ValueError, match="vocab_size"):
        unigram_log_probs(torch.tensor([5]), vocab_size=3)


def test_model_cross_entropy_equals_the_loss_over_windows() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).eval()
    stream = torch.randint(0, 50, (23,))
    got = model_cross_entropy(model, stream, seq_len=8, batch_size=2)
    total = 0.0
    with torch.no_grad():
        for w in eval_windows(stream, 8):
            logits = model(input_ids=w[None, :-1]).logits[0]
            total += float(torch.nn.functional.cross_entropy(logits, w[1:], reduction="sum"))
    assert math.isclose(got, total / 22, rel_tol=1e-5)


def test_lr_warms_up_then_decays_to_a_tenth() -> None:
    assert lr_at(0, 100, 1.0, 10) == pytest.approx(0.1)
    assert lr_at(9, 100, 1.0, 10) == pytest.approx(1.0)
    assert lr_at(99, 100, 1.0, 10) == pytest.approx(0.1, abs=1e-3)
    lrs = [lr_at(s, 100, 1.0, 10) for s in range(10, 100)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_batches_visit_every_window_once_per_epoch() -> None:
    starts = batch_starts(num_windows=6, seq_len=5, batch_size=4, steps=3, seed=0)
    flat = starts.flatten().tolist()
    assert sorted(flat[:6]) == sorted(flat[6:]) == [0, 5, 10, 15, 20, 25]
    assert torch.equal(starts, batch_starts(6, 5, 4, 3, seed=0))
    assert not torch.equal(starts, batch_starts(6, 5, 4, 3, seed=1))


def test_bpe_vocab_too_small_or_unreachable_is_refused() -> None:
    with pytest.raises(ValueError, match="vocab_size must be >= 261"):
        train_bpe_json(["x = 1\n"], 100)
    with pytest.raises(ValueError, match="not reachable"):
        train_bpe_json(["x = 1\n"], 4096)


def test_bad_flags_are_refused(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--out-dir", "x", "--seq-len", "0"])
    assert "--seq-len must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--out-dir", "x", "--epochs", "0"])


def _train(fake_stdlib: Path, out: Path, *extra: str) -> dict:
    assert main(["--out-dir", str(out), "--stdlib", str(fake_stdlib), *_TINY_FLAGS, *extra]) == 0
    return json.loads((out / "report.json").read_text())


@pytest.fixture(scope="module")
def tiny_run(fake_stdlib: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("tiny-run")
    return out, _train(fake_stdlib, out, "--tar")


def test_tiny_run_writes_tars_and_report(tiny_run: tuple[Path, dict]) -> None:
    out, report = tiny_run
    assert sorted(p.name for p in out.iterdir()) == ["demo-draft.tar", "demo-model.tar",
                                                     "report.json"]
    with tarfile.open(out / "demo-model.tar") as tar:
        names = sorted(tar.getnames())
    assert names == sorted(f"demo-model/{n}" for n in (
        "config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json",
        "tokenizer.json", "tokenizer_config.json"))
    assert report["held_out_modules"] == list(corpus.HELD_OUT_MODULES)
    assert report["files"]["train"] == len(_KEEP) - len(corpus.HELD_OUT_MODULES) - len(
        corpus.VALIDATION_MODULES) + 1  # + encodings/__init__.py
    assert report["tokens"]["held_out"] == 400 and report["tokens"]["train"] > 1000
    for key in ("main", "draft", "unigram"):
        assert math.isfinite(report[key]["held_out_ce"]) and report[key]["held_out_ce"] > 0
    assert report["main"]["params"] > report["draft"]["params"] > 0
    assert report["main"]["steps"] == 3 and report["main"]["best_step"] in (2, 3)
    assert set(report["versions"]) >= {"python", "torch", "transformers", "tokenizers"}
    assert "| main |" in report["markdown"] and "| unigram (add-one) |" in report["markdown"]


def test_tiny_run_folder_loads_in_transformers_with_its_report_numbers(
        tiny_run: tuple[Path, dict], tmp_path: Path, fake_stdlib: Path) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from peregrine.demo.evaluate import encode_documents
    out, report = tiny_run
    with tarfile.open(out / "demo-model.tar") as tar:
        tar.extractall(tmp_path, filter="data")
    folder = tmp_path / "demo-model"
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert model.config.tie_word_embeddings and model.config.max_position_embeddings == 32
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    held = corpus.load_split(fake_stdlib).held_out
    stream = encode_documents(tok, [f.text for f in held])[:400]
    # The report's number is the packaged (bf16) weights' CE, computed in float32.
    assert model_cross_entropy(model, stream, 32) == pytest.approx(
        report["main"]["held_out_ce"], abs=1e-4)


def _hashes(tar_path: Path) -> dict[str, str]:
    with tarfile.open(tar_path) as tar:
        return {m.name: hashlib.sha256(tar.extractfile(m).read()).hexdigest()
                for m in tar.getmembers()}


@pytest.mark.slow
def test_tiny_run_is_deterministic(tiny_run: tuple[Path, dict], fake_stdlib: Path,
                                   tmp_path: Path) -> None:
    out, report = tiny_run
    again = _train(fake_stdlib, tmp_path, "--tar")
    for name in ("demo-model.tar", "demo-draft.tar"):
        assert (out / name).read_bytes() == (tmp_path / name).read_bytes(), name
    assert again["main"]["held_out_ce"] == report["main"]["held_out_ce"]
    other = tmp_path / "seed1"
    _train(fake_stdlib, other, "--tar", "--seed", "1")
    assert (_hashes(other / "demo-model.tar")["demo-model/model.safetensors"]
            != _hashes(out / "demo-model.tar")["demo-model/model.safetensors"])
