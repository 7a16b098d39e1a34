"""What evaluators need: GET /tokenizer_info (lm-eval's remote tokenizer) and prompt scoring
with echo (max_tokens 0 or 1, logprobs), checked against transformers on the tiny llama."""
from __future__ import annotations

import httpx
import openai
import pytest
import torch

from fake_engine import FakeEngine
from server_utils import TINY_MODEL_NAME as MODEL
from server_utils import RunningServer

# NOTE: a two-byte character, and a text the tokenizer prefixes with a BOS it does not show.
TEXT = "The quick brown fox thé end"


@pytest.fixture(scope="module")
def client(real_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=real_server.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def hf(tiny_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, torch_dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_path)


def _hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i >= 1, and the greedy token at each position."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()  # (T, vocab)
    logp = torch.log_softmax(logits, -1)
    return logp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0], logp[:-1].argmax(-1)


# ----------------------------------------------------------------------------- /tokenizer_info
def test_tokenizer_info_describes_the_served_tokenizer(real_server, hf):
    _, tok = hf
    info = httpx.get(real_server.base_url + "/tokenizer_info").json()
    assert info["tokenizer_class"] == type(tok).__name__
    assert (info["bos_token"], info["eos_token"], info["pad_token"]) == (
        tok.bos_token, tok.eos_token, tok.pad_token)
    assert info["chat_template"] == tok.chat_template
    assert info["model_max_length"] == tok.model_max_length
    assert not {"vocab_file", "merges_file", "name_or_path"} & set(info)


def test_remote_tokenizer_reads_what_it_needs(real_server, hf):
    """lm-eval's remote backend: eos/bos ids by encoding their text without special tokens."""
    _, tok = hf
    info = httpx.get(real_server.base_url + "/tokenizer_info").json()
    for name in ("eos_token", "bos_token"):
        ids = httpx.post(real_server.base_url + "/tokenize",
                         json={"prompt": info[name], "add_special_tokens": False}).json()["tokens"]
        assert ids == [tok.convert_tokens_to_ids(info[name])]


def test_tokenizer_info_needs_the_api_key():
    with RunningServer(FakeEngine(), api_key="sekrit") as s:
        assert httpx.get(s.base_url + "/tokenizer_info").status_code == 401
        r = httpx.get(s.base_url + "/tokenizer_info", headers={"Authorization": "Bearer sekrit"})
        assert r.status_code == 200 and r.json()["tokenizer_class"]


# ----------------------------------------------------------------------------- echo scoring
def _check_offsets(text: str, lp) -> None:
    """Every token whose text the echo shows starts at its text_offset; offsets never go back."""
    assert lp.text_offset == sorted(lp.text_offset)
    assert all(0 <= o <= len(text) for o in lp.text_offset)
    for tok, off in zip(lp.tokens, lp.text_offset):
        if not tok.startswith("<|"):
            assert text[off:off + len(tok)] == tok, (tok, off, text)


def test_echo_max_tokens_0_scores_a_text_prompt(client, real_server, hf):
    model, tok = hf
    r = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=0, echo=True, logprobs=1)
    choice = r.choices[0]
    ids = tok.encode(TEXT)
    assert ids[0] == tok.bos_token_id  # the BOS the echoed text leaves out
    assert choice.text == TEXT and choice.finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None
    assert lp.text_offset[:2] == [0, 0]  # the BOS and the first visible token start the text
    _check_offsets(choice.text, lp)
    expected, _ = _hf_logprobs(model, ids)
    assert lp.token_logprobs[1:] == pytest.approx(expected.tolist(), abs=2e-3)


def test_echo_max_tokens_0_scores_a_token_id_prompt(client, hf):
    model, tok = hf
    ids = tok.encode(TEXT)
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=2)
    choice = r.choices[0]
    assert choice.text == tok.decode(ids)  # the BOS shows, so its offset counts
    lp = choice.logprobs
    assert lp.tokens[0] == tok.bos_token and lp.text_offset[1] == len(tok.bos_token)
    _check_offsets(choice.text, lp)
    assert all(2 <= len(top) <= 3 for top in lp.top_logprobs[1:])
    expected, _ = _hf_logprobs(model, ids)
    assert lp.token_logprobs[1:] == pytest.approx(expected.tolist(), abs=2e-3)


def test_loglikelihood_the_way_lm_eval_asks(client, hf):
    """Context + continuation as token ids, echo, max_tokens 1, logprobs 1, temperature 0: the
    continuation's logprobs are token_logprobs[ctxlen:-1], greedy when each is its row's max."""
    model, tok = hf
    context, continuation = tok.encode("def add(a, b):"), tok.encode(" return", add_special_tokens=False)
    ids = context + continuation
    r = client.completions.create(model=MODEL, prompt=[ids, ids[:-1]], max_tokens=1, echo=True,
                                  logprobs=1, temperature=0, seed=1234)
    expected, greedy = _hf_logprobs(model, ids)
    choice = r.choices[0]
    lp = choice.logprobs
    assert len(lp.token_logprobs) == len(ids) + 1  # the prompt, then the one generated token
    ctxlen = len(context)
    assert sum(lp.token_logprobs[ctxlen:-1]) == pytest.approx(
        expected[ctxlen - 1:].sum().item(), abs=5e-3)
    is_greedy = all(t == max(top.values()) for t, top in
                    zip(lp.token_logprobs[ctxlen:-1], lp.top_logprobs[ctxlen:-1]))
    assert is_greedy == bool((greedy[ctxlen - 1:] == torch.tensor(ids[ctxlen:])).all())
    _check_offsets(choice.text, lp)
    assert r.usage.completion_tokens == 2
    # the second prompt's generated token is the greedy next token after ids[:-1]
    gen = r.choices[1].logprobs
    assert gen.token_logprobs[-1] == pytest.approx(max(gen.top_logprobs[-1].values()))


def test_echo_max_tokens_0_without_logprobs_returns_the_prompt_only(client):
    r = client.completions.create(model=MODEL, prompt=[TEXT, "Hello"], max_tokens=0, echo=True)
    assert [c.text for c in r.choices] == [TEXT, "Hello"]
    assert r.usage.completion_tokens == 0
    chunks = list(client.completions.create(model=MODEL, prompt=TEXT, max_tokens=0, echo=True,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == TEXT


def test_max_tokens_0_needs_echo(real_server):
    r = httpx.post(real_server.base_url + "/v1/completions",
                   json={"prompt": TEXT, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = httpx.post(real_server.base_url + "/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
