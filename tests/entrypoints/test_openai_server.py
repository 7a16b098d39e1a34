"""The official openai client against the real server (tiny llama on CPU)."""
from __future__ import annotations

import httpx
import openai
import pytest

from server_utils import TINY_MODEL_NAME as MODEL
from peregrine.metrics import METRIC_NAMES

PROMPT = "The quick brown fox"
CHAT = [{"role": "user", "content": "Tell me about falcons."}]


@pytest.fixture(scope="module")
def client(real_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=real_server.base_url + "/v1", api_key="unused", max_retries=0)


def _tokenize(real_server, text: str) -> list[int]:
    return httpx.post(real_server.base_url + "/tokenize", json={"prompt": text}).json()["tokens"]


def test_completion_returns_text_usage_and_finish_reason(client, real_server):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    assert len(r.choices) == 1 and r.choices[0].text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(_tokenize(real_server, PROMPT))
    assert r.usage.completion_tokens == 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6


def test_streamed_completion_equals_non_streamed_greedy(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)


def test_stream_include_usage_sends_a_final_usage_chunk(client):
    chunks = list(client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])


def test_continuous_usage_stats_put_usage_in_every_chunk(client):
    """vLLM's stream_options.continuous_usage_stats: the running usage rides on every chunk."""
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4,
                                            temperature=0, stream=True, stream_options=opts))
    counts = [c.usage.completion_tokens for c in chunks]
    # NOTE: tokens that reach the stream together go out in one chunk, so the chunk count varies
    # with timing; the running count never goes back and ends at the total.
    assert counts == sorted(counts) and counts[-1] == 4 and counts[0] >= 1 and len(chunks) >= 2
    assert all(c.usage.prompt_tokens == chunks[0].usage.prompt_tokens > 0 for c in chunks)
    chat = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3,
                                               stream=True, stream_options=opts))
    assert all(c.usage is not None for c in chat) and chat[-1].usage.completion_tokens == 3
    assert chat[0].usage.completion_tokens == 0  # the role chunk comes before any token


def test_add_special_tokens_decides_whether_the_tokenizer_adds_its_own(client, real_server):
    with_specials = _tokenize(real_server, PROMPT)
    without = httpx.post(real_server.base_url + "/tokenize",
                         json={"prompt": PROMPT, "add_special_tokens": False}).json()["tokens"]
    assert len(with_specials) > len(without)  # the tiny tokenizer adds a BOS
    off = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1,
                                    extra_body={"add_special_tokens": False})
    assert off.usage.prompt_tokens == len(without)
    # Chat: the template writes its own special tokens; add_special_tokens adds the tokenizer's.
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1)
    added = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1,
                                           extra_body={"add_special_tokens": True})
    assert added.usage.prompt_tokens == plain.usage.prompt_tokens + len(with_specials) - len(without)


def test_chat_completion_uses_the_chat_template(client, real_server):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0)
    templated = httpx.post(real_server.base_url + "/tokenize", json={"messages": CHAT}).json()
    assert r.usage.prompt_tokens == templated["count"]
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 6


def test_streamed_chat_starts_with_role_and_matches_non_streamed(client):
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=8,
                                          temperature=0)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 8


def test_n_2_returns_two_choices_and_counts_both(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, n=2, seed=1)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens == 8
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, n=2,
                                                 stream=True, seed=2))
    finished = {ch.index for c in chunks for ch in c.choices if ch.finish_reason}
    assert finished == {0, 1}


def test_stop_string_ends_with_stop_reason(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    text = full.choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                  stop=[stop])
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and stop not in choice.text
    assert text.startswith(choice.text)
    assert choice.model_extra.get("stop_reason") == stop


def test_stop_token_id_ends_with_stop(client, real_server):
    full = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=8, temperature=0,
                                     logprobs=0)
    # Find a generated token whose text maps back to exactly one id: that id was generated.
    for k, text in enumerate(full.choices[0].logprobs.tokens):
        ids = httpx.post(real_server.base_url + "/tokenize",
                         json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
        if len(ids) == 1:
            break
    else:
        pytest.fail("no single-token text among the generated tokens")
    r = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=8, temperature=0,
                                  extra_body={"stop_token_ids": ids})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra.get("stop_reason") == ids[0]
    assert r.usage.completion_tokens <= k + 1


def test_completion_logprobs_have_one_row_per_token(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                                  logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and 2 <= len(top) <= 3
        assert max(top.values()) == pytest.approx(chosen)  # greedy picks the top token
    assert lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs_with_top_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for row in content:
        assert len(row.top_logprobs) == 3
        assert row.top_logprobs[0].logprob == pytest.approx(row.logprob)
        assert bytes(row.bytes).decode("utf-8", "replace") == row.token


def test_token_id_prompts_and_prompt_lists(client):
    ids = [[5, 6, 7, 8], [9, 10]]
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, n=2, temperature=0)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == 6 and r.usage.completion_tokens == 12
    single = client.completions.create(model=MODEL, prompt=ids[1], max_tokens=3, temperature=0)
    assert single.choices[0].text == r.choices[2].text == r.choices[3].text
    texts = client.completions.create(model=MODEL, prompt=["a b", "c d"], max_tokens=2)
    assert len(texts.choices) == 2


def test_echo_prepends_the_prompt(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                                  echo=True)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    assert r.choices[0].text == PROMPT + plain.choices[0].text


def test_truncate_prompt_tokens_keeps_the_last_tokens(client, real_server):
    """vLLM's truncate_prompt_tokens: the answer equals that of the kept tail alone."""
    ids = list(range(20, 60))
    kw = dict(model=MODEL, max_tokens=4, temperature=0)
    cut = client.completions.create(prompt=ids, extra_body={"truncate_prompt_tokens": 7}, **kw)
    tail = client.completions.create(prompt=ids[-7:], **kw)
    assert cut.usage.prompt_tokens == 7 and cut.choices[0].text == tail.choices[0].text
    # -1: as much as fits; a 300-token prompt would not fit max_model_len=256 otherwise
    long = client.completions.create(prompt=list(range(10, 310)), max_tokens=1,
                                     extra_body={"truncate_prompt_tokens": -1}, model=MODEL)
    assert long.usage.prompt_tokens == 255
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2,
                                          extra_body={"truncate_prompt_tokens": 5})
    assert chat.usage.prompt_tokens == 5
    r = httpx.post(real_server.base_url + "/v1/completions",
                   json={"model": MODEL, "prompt": ids, "truncate_prompt_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"


def test_prompt_logprobs_extra(real_server):
    """vLLM's prompt_logprobs: one entry per prompt token (None first) holding the token's own
    logprob and the top-k; the values agree with echo + logprobs."""
    url = real_server.base_url
    ids = [5, 9, 17, 33, 64, 101]
    body = {"model": MODEL, "prompt": ids, "max_tokens": 1, "temperature": 0}
    r = httpx.post(url + "/v1/completions", json=dict(body, prompt_logprobs=2)).json()
    plp = r["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for tid, entry in zip(ids[1:], plp[1:]):
        assert str(tid) in entry and entry[str(tid)]["rank"] >= 1
        ranks = sorted(e["rank"] for e in entry.values())
        assert ranks[:2] == [1, 2]
        assert all(e["logprob"] <= 0 and isinstance(e["decoded_token"], str) for e in entry.values())
    echo = httpx.post(url + "/v1/completions", json=dict(body, echo=True, logprobs=0)).json()
    echoed = echo["choices"][0]["logprobs"]["token_logprobs"][:len(ids)]
    assert echoed[0] is None
    for tid, entry, lp in zip(ids[1:], plp[1:], echoed[1:]):
        assert abs(entry[str(tid)]["logprob"] - lp) < 1e-5
    chat = httpx.post(url + "/v1/chat/completions", json={
        "model": MODEL, "messages": CHAT, "max_tokens": 1, "prompt_logprobs": 0}).json()
    chat_ids = httpx.post(url + "/tokenize", json={"messages": CHAT}).json()["tokens"]
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"] == len(chat_ids)
    assert chat["prompt_logprobs"][0] is None
    # prompt_logprobs=0: only the prompt's own token at each position
    assert [list(e) for e in chat["prompt_logprobs"][1:]] == [[str(t)] for t in chat_ids[1:]]
    bad = httpx.post(url + "/v1/completions", json=dict(body, prompt_logprobs=1, stream=True))
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_logprobs"


def test_logit_bias_steers_the_tokens(client, real_server):
    kw = dict(model=MODEL, prompt=[5, 6, 7], max_tokens=5, temperature=0.8, seed=3)
    text42 = httpx.post(real_server.base_url + "/detokenize", json={"tokens": [42]}).json()["prompt"]
    ids = client.completions.create(logit_bias={"42": 100}, logprobs=1, **kw).choices[0]
    assert ids.logprobs.tokens == [text42] * 5
    plain = client.completions.create(logprobs=1, **kw).choices[0]
    assert plain.logprobs.tokens != ids.logprobs.tokens


def test_seed_makes_sampling_reproducible(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=1234)
    assert client.completions.create(**kw).choices[0].text == \
        client.completions.create(**kw).choices[0].text


def test_sampling_extras_are_accepted(client):
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0.7, top_p=0.9, presence_penalty=0.5,
        frequency_penalty=0.5, user="someone",
        extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 6,
                    "ignore_eos": True})
    assert r.usage.completion_tokens == 6


def test_models_lists_the_served_model(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == 256


def test_tokenize_detokenize_round_trip(real_server):
    ids = _tokenize(real_server, "hello world")
    r = httpx.post(real_server.base_url + "/detokenize", json={"tokens": ids})
    assert r.status_code == 200 and r.json()["prompt"].endswith("hello world")


def test_version_and_health(real_server):
    import peregrine
    assert httpx.get(real_server.base_url + "/version").json() == {"version": peregrine.__version__}
    assert httpx.get(real_server.base_url + "/health").status_code == 200


def test_metrics_expose_every_name(client, real_server):
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    text = httpx.get(real_server.base_url + "/metrics").text
    for name in METRIC_NAMES:
        assert name in text, name
    assert f'model_name="{MODEL}"' in text
    assert 'finished_reason="length"' in text


def test_priority_needs_the_priority_policy(client):
    with pytest.raises(openai.BadRequestError, match="priority"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                  extra_body={"priority": 1})
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                  extra_body={"priority": 0})
    assert r.usage.completion_tokens == 2


def _token_texts(real_server, ids: list[int]) -> list[str]:
    url = real_server.base_url + "/detokenize"
    return [httpx.post(url, json={"tokens": [t]}).json()["prompt"] for t in ids]


def test_allowed_token_ids_restrict_every_output_token(client, real_server):
    allowed = [40, 41, 42]
    texts = set(_token_texts(real_server, allowed))
    assert len(texts) == len(allowed)  # NOTE: so each output token's text names its id
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=7, n=3, logprobs=0)
    restricted = client.completions.create(**kw, extra_body={"ignore_eos": True,
                                                              "allowed_token_ids": allowed})
    for choice in restricted.choices:
        assert len(choice.logprobs.tokens) == 8 and set(choice.logprobs.tokens) <= texts
    free = client.completions.create(**kw, extra_body={"ignore_eos": True})
    assert any(not set(c.logprobs.tokens) <= texts for c in free.choices)


def test_bad_words_keep_a_one_token_word_out_of_greedy_output(client, real_server):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=0)
    first = client.completions.create(**kw).choices[0].logprobs.tokens[0]
    word_ids = httpx.post(real_server.base_url + "/tokenize",
                          json={"prompt": first, "add_special_tokens": False}).json()["tokens"]
    assert len(word_ids) == 1  # NOTE: a one-token word is banned wherever it would appear
    banned = client.completions.create(**kw, extra_body={"bad_words": [first]}).choices[0]
    assert first not in banned.logprobs.tokens
