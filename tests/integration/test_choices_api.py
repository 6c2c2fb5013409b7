"""`n` choices on both endpoints, whole and streamed: each choice's own seed, one prompt computed
and billed once, a reservation that covers every choice, and tool calls and echo per choice."""

from __future__ import annotations

import json

import pytest

from tests.integration.billing_support import (
    app_client,
    assert_counters_match_ledger,
    complete,
    new_tenant,
    platform_of,
    set_budget,
)
from tests.integration.test_openai_api import sse_events

PROMPT = 11  # "hello world" with the byte-level tokenizer


def _text(api, key, **fields):
    body = {"model": "synthetic:tiny", "prompt": "hello world", "max_tokens": 6, "ignore_eos": True, **fields}
    r = api.post("/v1/completions", key, body)
    assert r.status_code == 200, r.text
    return r.json()


def test_each_choice_follows_its_own_seed_and_the_prompt_counts_once(api):
    key = api.key(api.tenant())
    body = _text(api, key, n=3, temperature=1.0, seed=7)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    texts = [c["text"] for c in body["choices"]]
    alone = [_text(api, key, temperature=1.0, seed=7 + i)["choices"][0]["text"] for i in range(3)]
    assert texts == alone and len(set(texts)) == 3
    assert all(c["finish_reason"] == "length" for c in body["choices"])
    usage = body["usage"]
    assert usage["prompt_tokens"] == PROMPT and usage["completion_tokens"] == 18
    assert usage["total_tokens"] == PROMPT + 18


def test_streamed_choices_match_the_whole_answer(api):
    key = api.key(api.tenant())
    fields = {"max_tokens": 7, "n": 3, "temperature": 0.8, "seed": 11}
    whole = api.chat(key, "stream three", **fields).json()
    r = api.chat(key, "stream three", stream=True, stream_options={"include_usage": True}, **fields)
    *chunks, usage_chunk = sse_events(r.text)
    per_index: dict[int, list[dict]] = {}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        per_index.setdefault(choice["index"], []).append(choice)
    assert sorted(per_index) == [0, 1, 2]
    for i, parts in per_index.items():
        assert parts[0]["delta"] == {"role": "assistant", "content": ""}
        finishes = [p["finish_reason"] for p in parts if p["finish_reason"] is not None]
        assert finishes == [whole["choices"][i]["finish_reason"]] and parts[-1]["finish_reason"] is not None
        text = "".join(p["delta"].get("content", "") for p in parts)
        assert text == whole["choices"][i]["message"]["content"]
    assert usage_chunk["choices"] == []
    for field in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert usage_chunk["usage"][field] == whole["usage"][field]
    assert usage_chunk["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the same prompt again


def test_choices_compute_their_prompt_once_and_bill_it_once(backend):
    """The engine computes the shared prompt's full blocks for the first choice only (the others take
    them from its cache); the response and the ledger count the prompt once, with no cache hit: the
    choices' sharing is not the tenant's cached input."""
    prompt = "a prompt long enough for two full blocks of KV, shared by four choices"  # 70 tokens
    with app_client(backend) as client:
        tenant, tenant_id, key = new_tenant(client, "choices")
        set_budget(client, tenant, 10_000)
        engine = platform_of(client).engine
        hits = engine.stats().kv.prefix_hit_tokens
        r = complete(client, key, prompt=prompt, n=4, max_tokens=5, ignore_eos=True)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] == len(prompt) and usage["completion_tokens"] == 20
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0
        assert engine.stats().kv.prefix_hit_tokens - hits == 3 * 64  # 4 full blocks of 16, for 3 choices
        (row,) = assert_counters_match_ledger(client, tenant, tenant_id)
        assert (row.prompt_tokens, row.cached_tokens, row.completion_tokens) == (len(prompt), 0, 20)
        assert row.request_id == r.headers["x-request-id"]


def test_the_reservation_covers_every_choice(backend):
    with app_client(backend) as client:
        tenant, tenant_id, key = new_tenant(client, "reserve")
        set_budget(client, tenant, PROMPT + 3 * 8 - 1)
        refused = complete(client, key, n=3, max_tokens=8)
        assert refused.status_code == 429, refused.text
        assert f"needs up to {PROMPT + 24}" in refused.json()["error"]["message"]
        assert complete(client, key, n=2, max_tokens=8).status_code == 200
        (row,) = assert_counters_match_ledger(client, tenant, tenant_id)
        assert row.prompt_tokens == PROMPT


def test_echo_puts_the_prompt_before_every_choice(api):
    key = api.key(api.tenant())
    body = _text(api, key, n=2, echo=True, temperature=1.0, seed=3, logprobs=1)
    for choice in body["choices"]:
        assert choice["text"].startswith("hello world")
        lp = choice["logprobs"]
        assert lp["token_logprobs"][0] is None and len(lp["tokens"]) == PROMPT + 6
        assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0


def test_each_choice_is_its_own_tool_call(api):
    key = api.key(api.tenant())
    tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]}}}
    r = api.chat(key, "pick one", n=2, max_tokens=40, temperature=1.0, seed=5, tools=[tool], tool_choice="required")
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    calls = [c["message"]["tool_calls"] for c in choices if c["finish_reason"] == "tool_calls"]
    ids = [call[0]["id"] for call in calls]
    assert len(set(ids)) == len(ids)
    for (call,) in calls:
        assert call["function"]["name"] == "pick" and isinstance(json.loads(call["function"]["arguments"])["k"], int)


@pytest.mark.parametrize("n", [0, 17])
def test_n_out_of_range_is_refused(api, n):
    r = api.chat(api.key(api.tenant()), n=n)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


def test_best_of_returns_the_choices_with_the_highest_log_probability_per_token(api):
    key = api.key(api.tenant())
    body = _text(api, key, best_of=4, n=2, temperature=1.0, seed=21)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert all(c["logprobs"] is None for c in body["choices"])  # ranked by them, shown only when asked
    assert body["usage"]["completion_tokens"] == 4 * 6  # every generated choice is billed

    def scored(seed: int) -> tuple[float, str]:
        choice = _text(api, key, temperature=1.0, seed=seed, logprobs=0)["choices"][0]
        values = choice["logprobs"]["token_logprobs"]
        return sum(values) / len(values), choice["text"]

    ranked = sorted((scored(21 + i) for i in range(4)), reverse=True)
    assert [c["text"] for c in body["choices"]] == [text for _, text in ranked[:2]]
    shown = _text(api, key, best_of=4, n=2, temperature=1.0, seed=21, logprobs=1)
    assert [c["text"] for c in shown["choices"]] == [c["text"] for c in body["choices"]]
    assert all(len(c["logprobs"]["tokens"]) == 6 for c in shown["choices"])


@pytest.mark.parametrize(("fields", "says"), [
    ({"best_of": 1, "n": 2}, "best_of must be in [n, 16]"),
    ({"best_of": 17}, "best_of must be in [n, 16]"),
    ({"best_of": 3, "stream": True}, "cannot be streamed"),
])
def test_bad_best_of_is_refused(api, fields, says):
    r = api.post("/v1/completions", api.key(api.tenant()), {"model": "synthetic:tiny", "prompt": "x", **fields})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "best_of" and says in err["message"]
