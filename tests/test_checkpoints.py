"""Tests for the locally built tokenizer and tiny checkpoints (peregrine.testing)."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from peregrine.testing import checkpoints as ck
from peregrine.testing import tokenizer as tk
from peregrine.testing.checkpoints import ARCHS, build_tiny_checkpoint, tiny_checkpoint

PROMPTS = ("The quick brown fox", "Once upon a time, in a small village",
           "def add(a, b):\n    return")


def _hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _greedy(model, tok, prompt: str, n: int = 32):
    ids = tok(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         output_scores=True, return_dict_in_generate=True,
                         pad_token_id=tok.pad_token_id)
    new = out.sequences[0, ids.shape[1]:].tolist()
    top2 = torch.stack([s[0].float().topk(2).values for s in out.scores])  # (n, 2)
    return new, (top2[:, 0] - top2[:, 1])


def _load(path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def test_tokenizer_rebuild_gives_identical_files(tmp_path: Path) -> None:
    tk._trained_tokenizer_json.cache_clear()
    tk.build_bpe_tokenizer(tmp_path / "a")
    tk._trained_tokenizer_json.cache_clear()
    tk.build_bpe_tokenizer(tmp_path / "b")
    assert _hashes(tmp_path / "a") == _hashes(tmp_path / "b")
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= set(
        _hashes(tmp_path / "a"))


def test_tokenizer_training_is_deterministic_across_processes() -> None:
    code = ("import hashlib; from peregrine.testing.tokenizer import _trained_tokenizer_json as f;"
            "print(hashlib.sha256(f(512).encode()).hexdigest())")
    root = str(Path(__file__).resolve().parents[1])
    other = subprocess.run([sys.executable, "-c", code], cwd=root, check=True,
                           capture_output=True, text=True).stdout.strip()
    tk._trained_tokenizer_json.cache_clear()
    assert other == hashlib.sha256(tk._trained_tokenizer_json(512).encode()).hexdigest()


def test_tokenizer_special_ids_and_bos() -> None:
    tok = tk.build_bpe_tokenizer(None)
    assert len(tok) == 512
    assert tok.convert_tokens_to_ids(list(tk.SPECIAL_TOKENS)) == [0, 1, 2, 3, 4]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 4)
    assert tok("hello").input_ids[0] == tok.bos_token_id
    assert tok("hello", add_special_tokens=False).input_ids[0] != tok.bos_token_id


def test_tokenizer_roundtrips_multibyte_text() -> None:
    tok = tk.build_bpe_tokenizer(None)
    text = "Le café très chaud 😀 東京 → ok\n\tdone"
    ids = tok(text, add_special_tokens=False).input_ids
    assert tok.decode(ids) == text
    # Some multi-byte characters are split over byte tokens that do not decode alone.
    assert any("\ufffd" in tok.decode([i]) for i in ids)


@pytest.mark.parametrize("arch", ARCHS)
def test_autotokenizer_matches_raw_tokenizer(arch: str) -> None:
    # transformers 5 rebuilds qwen2-type tokenizers' pre-tokenizer; encodings must not change.
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer
    path = tiny_checkpoint(arch)
    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    auto = AutoTokenizer.from_pretrained(path)
    text = "In 2025, 12345 cafés sold 3.5% more; it's   fine\n\n东京 😀 <|im_end|>"
    assert auto(text).input_ids == raw.encode(text).ids
    assert len(auto) == raw.get_vocab_size() == 512


def test_tokenizer_rejects_unreachable_vocab_size() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        tk.build_bpe_tokenizer(None, vocab_size=100)
    with pytest.raises(ValueError, match="not reachable"):
        tk.build_bpe_tokenizer(None, vocab_size=50_000)


def test_chat_template_renders_generation_prompt(tmp_path: Path) -> None:
    from transformers import AutoTokenizer
    tk.build_bpe_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    with_prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert with_prompt == ("<|begin_of_text|><|im_start|>system\nBe brief.<|im_end|>\n"
                           "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")
    without = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    assert with_prompt == without + "<|im_start|>assistant\n"


def test_chat_template_accepts_text_parts() -> None:
    tok = tk.build_bpe_tokenizer(None)
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                          {"type": "text", "text": "b"}]}]
    rendered = tok.apply_chat_template(parts, tokenize=False)
    assert rendered == "<|begin_of_text|><|im_start|>user\nab<|im_end|>\n"


def test_tokenizer_without_chat_template(tmp_path: Path) -> None:
    tok = tk.build_bpe_tokenizer(tmp_path, with_chat_template=False)
    assert tok.chat_template is None
    assert "chat_template" not in json.loads((tmp_path / "tokenizer_config.json").read_text())


def test_checkpoint_rebuild_gives_identical_files(tmp_path: Path) -> None:
    a = build_tiny_checkpoint(tmp_path / "a", "qwen2", num_shards=2)
    b = build_tiny_checkpoint(tmp_path / "b", "qwen2", num_shards=2)
    assert _hashes(a) == _hashes(b)
    c = build_tiny_checkpoint(tmp_path / "c", "qwen2", num_shards=2, seed=1)
    assert _hashes(c)["model-00001-of-00002.safetensors"] != \
        _hashes(a)["model-00001-of-00002.safetensors"]


@pytest.mark.parametrize("arch", ARCHS)
def test_arch_loads_back_and_greedy_text_varies(arch: str) -> None:
    path = tiny_checkpoint(arch)
    model, tok = _load(path)
    expected = ck._TINY_ARCH[arch][0]
    assert type(model).__name__ == expected
    assert json.loads((path / "config.json").read_text())["architectures"] == [expected]
    assert model.config.vocab_size == len(tok) == 512
    for prompt in PROMPTS:
        new, gaps = _greedy(model, tok, prompt)
        assert len(set(new)) >= 8, (prompt, new)
        assert gaps.median() > 0.2, (prompt, gaps)


def test_llama3_rope_scaling_is_written_and_matters() -> None:
    from transformers import AutoModelForCausalLM
    path = tiny_checkpoint("llama3")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["rope_scaling"]["rope_type"] == "llama3"
    assert cfg["rope_scaling"]["original_max_position_embeddings"] == 64
    assert cfg["rope_theta"] == 500000.0
    scaled = AutoModelForCausalLM.from_pretrained(path).eval()
    assert scaled.config.rope_parameters["rope_type"] == "llama3"
    plain = AutoModelForCausalLM.from_pretrained(
        path, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}).eval()
    ids = torch.arange(5, 45).unsqueeze(0)  # (1, 40)
    with torch.no_grad():
        diff = (scaled(ids).logits - plain(ids).logits).abs().max()
    assert diff > 1e-2


def test_qwen_specifics() -> None:
    q2, _ = _load(tiny_checkpoint("qwen2"))
    attn2 = q2.model.layers[0].self_attn
    assert attn2.q_proj.bias is not None and attn2.q_proj.bias.abs().sum() > 0
    q3, _ = _load(tiny_checkpoint("qwen3"))
    attn3 = q3.model.layers[0].self_attn
    assert q3.config.head_dim == 32 != q3.config.hidden_size // q3.config.num_attention_heads
    assert attn3.q_proj.weight.shape == (4 * 32, 64)
    assert attn3.k_proj.weight.shape == (2 * 32, 64)
    assert not torch.allclose(attn3.q_norm.weight, torch.ones(32))
    assert q3.lm_head.weight.data_ptr() == q3.model.embed_tokens.weight.data_ptr()
    with safe_open(str(tiny_checkpoint("qwen3") / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()


def test_sharded_index_is_correct(tmp_path: Path) -> None:
    path = build_tiny_checkpoint(tmp_path / "s", "llama", num_shards=3)
    shards = sorted(p.name for p in path.glob("*.safetensors"))
    assert shards == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    assert not (path / "model.safetensors").exists()
    index = json.loads((path / "model.safetensors.index.json").read_text())
    total, seen = 0, {}
    for shard in shards:
        with safe_open(str(path / shard), "pt") as f:
            for key in f.keys():
                seen[key] = shard
                t = f.get_tensor(key)
                total += t.numel() * t.element_size()
    assert index["weight_map"] == seen
    assert index["metadata"]["total_size"] == total
    single = tiny_checkpoint("llama")
    sharded_model, _ = _load(path)
    single_model, _ = _load(single)
    ids = torch.arange(5, 25).unsqueeze(0)  # (1, 20)
    with torch.no_grad():
        assert torch.equal(sharded_model(ids).logits, single_model(ids).logits)


def test_bf16_checkpoint_dtype(tmp_path: Path) -> None:
    path = build_tiny_checkpoint(tmp_path / "bf", "mistral", dtype=torch.bfloat16)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["torch_dtype"] == cfg["dtype"] == "bfloat16"
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}


def test_without_tokenizer_same_weights_no_tokenizer_files(tmp_path: Path) -> None:
    path = build_tiny_checkpoint(tmp_path / "nt", "llama", with_tokenizer=False)
    names = {p.name for p in path.iterdir()}
    assert not names & {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}
    with_tok = tiny_checkpoint("llama")
    assert _hashes(path)["model.safetensors"] == _hashes(with_tok)["model.safetensors"]


def test_config_overrides_apply(tmp_path: Path) -> None:
    path = build_tiny_checkpoint(tmp_path / "o", "llama", num_hidden_layers=3, vocab_size=640)
    cfg = json.loads((path / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["vocab_size"]) == (3, 640)
    with pytest.raises(ValueError, match="with_tokenizer=False"):
        build_tiny_checkpoint(tmp_path / "small", "llama", vocab_size=300)


def test_unknown_arch_and_bad_args_raise(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown arch"):
        build_tiny_checkpoint(tmp_path / "x", "gpt2")
    with pytest.raises(ValueError, match="num_shards"):
        build_tiny_checkpoint(tmp_path / "y", "llama", num_shards=0)


def test_tiny_checkpoint_caches_by_arguments() -> None:
    a = tiny_checkpoint("llama", seed=3)
    assert tiny_checkpoint("llama", seed=3) == a
    assert tiny_checkpoint("llama", seed=4) != a


def test_engine_config_reads_tiny_checkpoints() -> None:
    from peregrine.config import EngineArgs
    cfg = EngineArgs(model=str(tiny_checkpoint("qwen3"))).create_engine_config().model
    assert (cfg.architecture, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == \
        ("Qwen3ForCausalLM", 4, 2, 32)
    assert cfg.dtype == torch.float32 and cfg.vocab_size == 512 and cfg.max_model_len == 512
    assert cfg.eos_token_ids == (1, 3)


def test_prefill_graph_tokens_are_validated_and_capped_by_the_token_budget() -> None:
    from peregrine.config import EngineArgs
    from peregrine.worker.cuda_graphs import prefill_graph_sizes
    path = str(tiny_checkpoint("qwen3"))
    with pytest.raises(ValueError, match="max_prefill_graph_tokens"):
        EngineArgs(model=path, max_prefill_graph_tokens=-1).create_engine_config()
    cfg = EngineArgs(model=path, max_num_batched_tokens=300).create_engine_config()
    assert cfg.max_prefill_graph_tokens == 300
    sizes = prefill_graph_sizes(cfg.max_prefill_graph_tokens)
    assert sizes[0] == 8 and sizes[-1] == 300 and sizes == sorted(set(sizes))
    assert prefill_graph_sizes(0) == []


# NOTE: tensor parallelism runs when the model's heads divide by it (4 heads: 3 does not), pipeline
# parallelism when every stage gets a layer (2 layers: 3 stages do not).
@pytest.mark.parametrize("field,size", [("tensor_parallel_size", 3), ("pipeline_parallel_size", 3)])
def test_parallel_sizes_that_cannot_run_are_refused_by_name(field: str, size: int) -> None:
    from peregrine.config import EngineArgs
    path = str(tiny_checkpoint("qwen3"))
    with pytest.raises(ValueError, match=f"invalid {field}"):
        EngineArgs(model=path, **{field: size}).create_engine_config()
    assert EngineArgs(model=path).create_engine_config().world_size == 1
