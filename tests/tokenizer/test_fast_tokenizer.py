"""FastTokenizer gives transformers' AutoTokenizer results on the demo model and the tiny test
checkpoints (ids, offsets, decoded text, tokens, special tokens, chat templates), and folders it
cannot match exactly load through transformers."""
from __future__ import annotations

import copy
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from peregrine.demo import demo_model_path
from peregrine.engine.detokenizer import IncrementalDetokenizer
from peregrine.entrypoints.openai.serving_tokenization import tokenizer_info
from peregrine.sampling_params import SamplingParams
from peregrine.testing import build_bpe_tokenizer, tiny_checkpoint
from peregrine.tokenizer import FastTokenizer, load_tokenizer, plain_fast_config

TEXTS = [
    "", " ", "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Hello, world! It's 3.14 -- isn't it?", "  leading and trailing  \n\n\t tabs\t",
    "naïve café, 東京, emoji 🦅🚀, combining é", "<|begin_of_text|>inside<|end_of_text|> text",
    "<|im_start|>user\nhi<|im_end|>\n<pad><pad>", "x" * 300, "\r\n\r\nwindows\r\nlines",
]

# A multi-line template, as real ones are: trim_blocks / lstrip_blocks decide its whitespace.
TOOL_TEMPLATE = """{%- set ns = namespace(sys='') -%}
{%- for m in messages if m['role'] == 'system' %}{% set ns.sys = m['content'] %}{% endfor -%}
{{ bos_token }}
{% if ns.sys %}
    SYSTEM: {{ ns.sys }}
{% endif %}
{% if tools %}
    TOOLS: {{ tools | tojson }}
{% endif %}
{% if documents %}
    {% for d in documents %}
DOC {{ d.title }}: {{ d.text }}
    {% endfor %}
{% endif %}
{% for m in messages %}
    {% if m['role'] == 'system' %}{% continue %}{% endif %}
<|im_start|>{{ m['role'] }}
    {% if m.reasoning_content is defined %}
<think>{{ m.reasoning_content }}</think>
    {% endif %}
    {% if m['role'] == 'assistant' %}
        {% generation %}{{ m['content'] }}{% endgeneration %}
    {% else %}
{{ m['content'] }}
    {% endif %}
    {% if m.tool_calls is defined %}{{ m.tool_calls | tojson(indent=2) }}{% endif %}
<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
{% if custom_flag is defined %}[flag={{ custom_flag }} {{ dict(a=1) | tojson }}]{% endif %}"""

# NOTE: no None-valued message fields: transformers releases differ on them (5.17 drops
# "tool_calls": None before rendering, 5.24 passes it to the template).
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "naïve 東京 🦅"},
     {"role": "assistant", "content": "ok"},
     {"role": "user", "content": [{"type": "text", "text": "part one"},
                                  {"type": "text", "text": " and two"}]}],
    [{"role": "user", "content": "think"},
     {"role": "assistant", "content": "answer", "reasoning": "because"}],
]


def _folders(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("tokenizers")
    # transformers 5's own save: chat_template.jinja, extra_special_tokens, its class name
    v5 = tmp / "v5_save"
    tok = build_bpe_tokenizer(None)
    tok.save_pretrained(str(v5))
    return {"demo": Path(demo_model_path()), "tiny_llama": tiny_checkpoint("llama"),
            "tiny_qwen3": tiny_checkpoint("qwen3"), "v5_save": v5}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> dict[str, tuple[FastTokenizer, object]]:
    from transformers import AutoTokenizer
    out = {}
    for name, folder in _folders(tmp_path_factory).items():
        ours = load_tokenizer(str(folder))
        assert isinstance(ours, FastTokenizer), (name, plain_fast_config(folder)[1])
        out[name] = (ours, AutoTokenizer.from_pretrained(str(folder)))
    return out


NAMES = ["demo", "tiny_llama", "tiny_qwen3", "v5_save"]


@pytest.mark.parametrize("name", NAMES)
def test_encode_and_call_match_transformers(pairs, name) -> None:
    ours, hf = pairs[name]
    for text in TEXTS:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == \
                hf.encode(text, add_special_tokens=special), (text, special)
            assert ours(text, add_special_tokens=special, return_offsets_mapping=True) == \
                dict(hf(text, add_special_tokens=special, return_offsets_mapping=True))
    assert ours(TEXTS[:4]) == dict(hf(TEXTS[:4]))


@pytest.mark.parametrize("name", NAMES)
def test_decode_and_tokens_match_transformers(pairs, name) -> None:
    ours, hf = pairs[name]
    rng = random.Random(0)
    n = len(hf)
    seqs = [[rng.randrange(n) for _ in range(rng.randrange(1, 40))] for _ in range(200)]
    seqs += [list(range(n)), [0, 1, 2, 3, 4, 5], hf.encode(TEXTS[5])]
    for ids in seqs:
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == \
                hf.decode(ids, skip_special_tokens=skip), (ids, skip)
        assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
        assert ours.convert_ids_to_tokens(ids, skip_special_tokens=True) == \
            hf.convert_ids_to_tokens(ids, skip_special_tokens=True)
    assert ours.decode(7) == hf.decode(7)
    assert ours.convert_ids_to_tokens(7) == hf.convert_ids_to_tokens(7)
    assert ours.batch_decode(seqs[:5]) == hf.batch_decode(seqs[:5])
    tokens = hf.convert_ids_to_tokens(list(range(n))) + ["not-a-token", "<|im_end|>"]
    assert ours.convert_tokens_to_ids(tokens) == hf.convert_tokens_to_ids(tokens)
    assert ours.convert_tokens_to_ids("<pad>") == hf.convert_tokens_to_ids("<pad>")


@pytest.mark.parametrize("name", NAMES)
def test_vocabulary_and_special_tokens_match_transformers(pairs, name) -> None:
    ours, hf = pairs[name]
    assert (len(ours), ours.vocab_size) == (len(hf), hf.vocab_size)
    assert ours.get_vocab() == hf.get_vocab()
    assert ours.get_added_vocab() == hf.get_added_vocab()
    assert {i: repr(t) for i, t in ours.added_tokens_decoder.items()} == \
        {i: repr(t) for i, t in hf.added_tokens_decoder.items()}
    for attr in ("bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token",
                 "mask_token"):
        assert getattr(ours, attr) == getattr(hf, attr), attr
        assert getattr(ours, attr + "_id") == getattr(hf, attr + "_id"), attr
    assert ours.special_tokens_map == hf.special_tokens_map
    assert ours.all_special_tokens == hf.all_special_tokens
    assert ours.all_special_ids == hf.all_special_ids
    assert ours.model_max_length == hf.model_max_length
    assert ours.chat_template == hf.chat_template
    theirs = tokenizer_info(hf)
    mine = tokenizer_info(ours)
    assert mine == {k: v for k, v in theirs.items() if k in mine}
    with pytest.raises(AttributeError):
        ours.no_such_attribute  # noqa: B018


@pytest.mark.parametrize("name", NAMES)
def test_chat_templates_render_as_transformers_renders_them(pairs, name) -> None:
    ours, hf = pairs[name]
    tools = [{"type": "function", "function": {"name": "f", "description": "é <b>",
                                                "parameters": {"type": "object"}}}]
    docs = [{"title": "t", "text": "body"}]
    for conv in CONVERSATIONS:
        for gen in (False, True):
            for template in (None, TOOL_TEMPLATE):
                kw = dict(tokenize=False, add_generation_prompt=gen, chat_template=template)
                assert ours.apply_chat_template(conv, **kw) == hf.apply_chat_template(conv, **kw)
            kw = dict(add_generation_prompt=gen, chat_template=TOOL_TEMPLATE, tools=tools,
                      documents=docs, custom_flag=3)
            assert ours.apply_chat_template(conv, tokenize=False, **kw) == \
                hf.apply_chat_template(conv, tokenize=False, **kw)
            # NOTE: tokenizing a chat is encoding its rendered text without adding special
            # tokens; transformers' own tokenize=True return type changed between versions.
            text = hf.apply_chat_template(conv, tokenize=False, **kw)
            assert ours.apply_chat_template(conv, **kw) == \
                hf(text, add_special_tokens=False)["input_ids"]
    cont = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "def f("}]
    for template in (None, TOOL_TEMPLATE):
        kw = dict(tokenize=False, continue_final_message=True, chat_template=template)
        assert ours.apply_chat_template(cont, **kw) == hf.apply_chat_template(cont, **kw)


def test_chat_template_errors_are_clear(pairs) -> None:
    ours, _ = pairs["demo"]
    with pytest.raises(ValueError, match="empty conversation"):
        ours.apply_chat_template([], tokenize=False)
    with pytest.raises(ValueError, match="both"):
        ours.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                 add_generation_prompt=True, continue_final_message=True)
    import jinja2
    with pytest.raises(jinja2.TemplateError, match="no system"):
        ours.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                 chat_template="{{ raise_exception('no system') }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        ours.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                 chat_template="{{ ''.__class__.__mro__ }}")


def test_detokenizer_and_copies_give_the_same_text(pairs) -> None:
    ours, hf = pairs["demo"]
    ids = hf.encode(TEXTS[2] + TEXTS[5], add_special_tokens=False)
    prompt = hf.encode("def f():")
    for params in (SamplingParams(), SamplingParams(skip_special_tokens=False,
                                                    spaces_between_special_tokens=False)):
        texts = []
        for tok in (ours, hf, copy.deepcopy(ours)):
            d = IncrementalDetokenizer(tok, prompt, params)
            for i in ids + [2, 3, 0]:
                d.update([i])
            texts.append(d.output_text)
        assert texts[0] == texts[1] == texts[2]


def _write(folder: Path, **changes) -> Path:
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    cfg_path.write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize("changes,reason", [
    ({"tokenizer_class": "LlamaTokenizer"}, "class of its own"),
    ({"add_bos_token": True}, "post-processor"),
    ({"clean_up_tokenization_spaces": True}, "clean_up"),
    ({"auto_map": {"AutoTokenizer": ["x.Tok", None]}}, "remote code"),
    ({"pad_token": "<new-pad>"}, "not a special added token"),
    ({"image_token": "<image>"}, "model-specific"),
])
def test_folders_transformers_would_change_load_through_transformers(tmp_path, changes,
                                                                       reason) -> None:
    folder = tmp_path / "tok"
    shutil.copytree(demo_model_path(), folder,
                    ignore=shutil.ignore_patterns("*.safetensors"))
    (folder / "special_tokens_map.json").unlink()
    _write(folder, **changes)
    if "auto_map" in changes:
        assert reason in plain_fast_config(folder)[1]
        return
    cfg, why = plain_fast_config(folder)
    if cfg is not None:
        with pytest.raises(ValueError, match=reason):
            FastTokenizer.from_folder(folder)
    else:
        assert reason in why
    tok = load_tokenizer(str(folder))
    assert not isinstance(tok, FastTokenizer)
    # what transformers itself makes of the folder (a class of its own may split text its way)
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(str(folder))
    assert type(tok) is type(hf)
    assert tok.encode("def f(x):") == hf.encode("def f(x):")
    assert tok.decode(tok.encode("def f(x):")) == hf.decode(hf.encode("def f(x):"))


def test_a_folder_without_a_tokenizer_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(ValueError, match="could not load a tokenizer"):
        load_tokenizer(str(tmp_path))


def test_loading_the_demo_tokenizer_imports_no_transformers() -> None:
    code = ("import sys; from peregrine.tokenizer import load_tokenizer; "
            "from peregrine.demo import demo_model_path; "
            "t = load_tokenizer(demo_model_path()); t.encode('x'); "
            "t.apply_chat_template([{'role': 'user', 'content': 'x'}]); "
            "print(type(t).__name__, 'transformers' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True).stdout
    assert out.split() == ["FastTokenizer", "False", "False"]
