"""Log-probabilities through the tenant API, on Postgres + Redis and on SQLite: chat's
`logprobs` / `top_logprobs` and the legacy `/v1/completions` `logprobs: k`, whole and streamed, and the
400s for what does not fit either shape."""

from __future__ import annotations

import math

import pytest

from tests.integration.test_openai_api import _error, sse_events


def test_chat_logprobs_cover_every_token_with_its_alternatives(api):
    key = api.key(api.tenant())
    body = api.chat(key, "tell me", max_tokens=9, logprobs=True, top_logprobs=3).json()
    (choice,) = body["choices"]
    content = choice["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"]
    for entry in content:
        assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 3
        tops = [t["logprob"] for t in entry["top_logprobs"]]
        assert tops == sorted(tops, reverse=True) and entry["logprob"] <= tops[0] + 1e-6
        assert bytes(entry["bytes"]).decode("utf-8", errors="replace") == entry["token"]
    # the tokens' bytes are exactly the answer (greedy, no stop string: nothing was cut)
    assert b"".join(bytes(e["bytes"]) for e in content).decode("utf-8", errors="replace") == \
        choice["message"]["content"]
    plain = api.chat(key, "tell me", max_tokens=9).json()["choices"][0]
    assert plain["logprobs"] is None and plain["message"] == choice["message"]


def test_chat_stream_carries_the_same_logprobs_chunk_by_chunk(api):
    key = api.key(api.tenant())
    whole = api.chat(key, "stream", max_tokens=7, logprobs=True, top_logprobs=2).json()["choices"][0]["logprobs"]
    chunks = sse_events(api.chat(key, "stream", max_tokens=7, logprobs=True, top_logprobs=2, stream=True).text)
    streamed = [e for c in chunks for e in (c["choices"][0].get("logprobs") or {"content": []})["content"]]
    assert streamed == whole["content"]
    assert chunks[0]["choices"][0]["logprobs"] is None  # the role chunk carries no token


def test_completions_logprobs_use_the_legacy_shape(api):
    key = api.key(api.tenant())
    r = api.post("/v1/completions", key, {"model": "synthetic:tiny", "prompt": "abc", "max_tokens": 6,
                                          "temperature": 0, "logprobs": 2})
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    lp = choice["logprobs"]
    n = r.json()["usage"]["completion_tokens"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    offset = 0
    for token, logprob, top, at in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], lp["text_offset"],
                                       strict=True):
        # the chosen token is included; tokens of the same text (this model has many empty ones) share a key
        assert at == offset and top[token] == logprob and 1 <= len(top) <= 3
        assert all(math.isfinite(v) and v <= 0 for v in top.values())
        offset += len(token)
    assert "".join(lp["tokens"]) == choice["text"]
    chunks = sse_events(api.post("/v1/completions", key, {"model": "synthetic:tiny", "prompt": "abc", "max_tokens": 6,
                                                          "temperature": 0, "logprobs": 2, "stream": True}).text)
    parts = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    assert [t for p in parts for t in p["tokens"]] == lp["tokens"]
    assert [o for p in parts for o in p["text_offset"]] == lp["text_offset"]  # offsets run on across chunks


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 3}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
])
def test_logprobs_that_fit_neither_shape_answer_400(api, path, body, param):
    key = api.key(api.tenant())
    base = {"model": "synthetic:tiny", "max_tokens": 3}
    base.update({"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"})
    r = api.post(path, key, {**base, **body})
    _error(r, 400, "invalid_request" if body.get("logprobs") == 21 else "invalid_value", param)


def _complete(api, key, **fields):
    r = api.post("/v1/completions", key, {"model": "synthetic:tiny", "max_tokens": 5, "temperature": 0, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_puts_the_prompt_first_and_scores_its_tokens(api):
    key = api.key(api.tenant())
    plain = _complete(api, key, prompt="The cat sat")
    echoed = _complete(api, key, prompt="The cat sat", echo=True)
    assert echoed["choices"][0]["text"] == "The cat sat" + plain["choices"][0]["text"]
    assert echoed["choices"][0]["logprobs"] is None
    scored = _complete(api, key, prompt="The cat sat", echo=True, logprobs=1)
    (choice,) = scored["choices"]
    lp, usage = choice["logprobs"], scored["usage"]
    ended_by_eos = choice["finish_reason"] == "stop"  # the end token has no entry, as OpenAI leaves it out
    assert len(lp["tokens"]) == usage["prompt_tokens"] + usage["completion_tokens"] - ended_by_eos
    assert "".join(lp["tokens"]) == choice["text"] == echoed["choices"][0]["text"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing predicts the first token
    assert all(v <= 0 for v in lp["token_logprobs"][1:])  # the prompt's loglikelihood is their sum
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0  # scored prompts skip the prefix cache


def test_max_tokens_0_with_echo_scores_the_prompt_alone(api):
    """The older evaluation harnesses' request: the prompt's log-probabilities, nothing generated."""
    key = api.key(api.tenant())
    scored = _complete(api, key, prompt="The cat sat", echo=True, logprobs=1, max_tokens=0)
    (choice,) = scored["choices"]
    assert choice["text"] == "The cat sat" and choice["finish_reason"] == "length"
    assert "".join(choice["logprobs"]["tokens"]) == "The cat sat"
    assert scored["usage"]["completion_tokens"] == 0
    longer = _complete(api, key, prompt="The cat sat", echo=True, logprobs=1, max_tokens=3)["choices"][0]["logprobs"]
    n = len(choice["logprobs"]["tokens"])
    assert choice["logprobs"]["token_logprobs"] == longer["token_logprobs"][:n]
    assert _complete(api, key, prompt="The cat sat", max_tokens=0)["choices"][0]["text"] == ""


def test_echo_of_token_ids_and_streamed_echo(api):
    key = api.key(api.tenant())
    ids = list(b"Hi there")  # the byte-level model's token ids are bytes
    assert _complete(api, key, prompt=ids, echo=True)["choices"][0]["text"].startswith("Hi there")
    whole = _complete(api, key, prompt="stream me", echo=True, logprobs=2)["choices"][0]
    chunks = sse_events(api.post("/v1/completions", key, {"model": "synthetic:tiny", "prompt": "stream me",
                                                          "max_tokens": 5, "temperature": 0, "echo": True,
                                                          "logprobs": 2, "stream": True}).text)
    assert chunks[0]["choices"][0]["text"].startswith("stream me")
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    tokens = [t for c in chunks if c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["tokens"]]
    assert tokens == whole["logprobs"]["tokens"]
