"""The tenant API on Postgres + Redis and on SQLite + in-process counters: OpenAI's shapes,
streaming, errors, model resolution, priority, cache salt and the usage hook."""

from __future__ import annotations

import json

import pytest


def sse_events(text: str) -> list:
    lines = [line for line in text.split("\n\n") if line.strip()]
    assert all(line.startswith("data: ") for line in lines), text
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def test_chat_completion_has_openai_shape(api):
    key = api.key(api.tenant())
    r = api.chat(key, max_tokens=6)
    assert r.status_code == 200, r.text
    body = r.json()
    rid = r.headers["x-request-id"]
    assert rid.startswith("req_") and body["id"] == "chatcmpl-" + rid[len("req_"):]
    assert body["object"] == "chat.completion" and isinstance(body["created"], int)
    assert body["model"] == "synthetic:tiny"
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    assert 1 <= usage["completion_tokens"] <= 6
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 0


def test_stream_with_usage_matches_the_non_streaming_answer(api):
    key = api.key(api.tenant())
    plain = api.chat(key, "stream me", max_tokens=10).json()
    r = api.chat(key, "stream me", max_tokens=10, stream=True, stream_options={"include_usage": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks = sse_events(r.text)
    assert all(c["object"] == "chat.completion.chunk" and c["id"].startswith("chatcmpl-") for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    *content, last, usage_chunk = chunks
    assert last["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert usage_chunk["choices"] == []
    for field in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert usage_chunk["usage"][field] == plain["usage"][field]
    assert usage_chunk["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the same prompt again
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in content)
    assert text == plain["choices"][0]["message"]["content"]


def test_stream_without_include_usage_has_no_usage_field(api):
    key = api.key(api.tenant())
    chunks = sse_events(api.chat(key, max_tokens=3, stream=True).text)
    assert chunks and all("usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_text_completion_defaults_to_16_tokens_and_takes_token_ids(api):
    key = api.key(api.tenant())
    r = api.post("/v1/completions", key, {"model": "synthetic:tiny", "prompt": "once upon", "temperature": 0,
                                           "ignore_me": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"][0]["text"] is not None and body["usage"]["completion_tokens"] <= 16
    assert body["usage"]["prompt_tokens"] == len("once upon")  # byte-level tokenizer
    ids = api.post("/v1/completions", key, {"model": "synthetic:tiny", "prompt": [104, 105], "max_tokens": 2})
    assert ids.status_code == 200 and ids.json()["usage"]["prompt_tokens"] == 2
    # ignore_eos: sampled at temperature 1, the synthetic model ends about 1 stream in 80 early on its EOS
    stream = api.post("/v1/completions", key, {"model": "synthetic:tiny", "prompt": "x", "max_tokens": 3,
                                                "ignore_eos": True, "stream": True,
                                                "stream_options": {"include_usage": True}})
    chunks = sse_events(stream.text)
    assert chunks[-1]["usage"]["completion_tokens"] == 3 and chunks[-1]["choices"] == []


def _error(r, status: int, code: str | None, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == code
    if param is not None:
        assert err["param"] == param
    assert r.headers["x-request-id"].startswith("req_")
    return err


def test_authentication_errors_never_echo_the_key(api):
    wrong = "lpx-" + "x" * 40
    err = _error(api.chat(wrong), 401, "invalid_api_key")
    assert err["type"] == "authentication_error" and wrong not in json.dumps(err)
    _error(api.client.post("/v1/chat/completions", json={}), 401, "invalid_api_key")
    _error(api.chat("not-a-key"), 401, "invalid_api_key")


@pytest.mark.parametrize(("body", "param"), [
    ({"max_tokens": "many"}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2**40}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"n": 0}, "n"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"messages": "hello"}, "messages"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
])
def test_invalid_fields_answer_400_naming_the_field(api, body, param):
    key = api.key(api.tenant())
    _error(api.chat(key, **body), 400, _code_for(param), param)


def _code_for(param: str) -> str:
    return {"temperature": "invalid_request", "top_p": "invalid_request", "min_p": "invalid_request"}.get(
        param, "invalid_value")


def test_context_length_and_unknown_routes_and_methods(api):
    key = api.key(api.tenant())
    err = _error(api.chat(key, "x" * 3000), 400, "context_length_exceeded")
    assert "maximum context length" in err["message"]
    _error(api.client.get("/v1/nothing"), 404, "unknown_url")
    _error(api.client.delete("/v1/models"), 405, "method_not_allowed")
    malformed = api.client.post("/v1/chat/completions", content=b"{nope", headers={"authorization": f"Bearer {key}"})
    assert malformed.status_code == 400 and malformed.json()["error"]["type"] == "invalid_request_error"


def test_models_lists_bases_and_only_own_adapters(api, peft_dirs):
    mine, other = api.tenant("mine"), api.tenant("other")
    assert api.adapter(mine, "helper", peft_dirs[0]).status_code == 201
    assert api.adapter(other, "secret", peft_dirs[1]).status_code == 201
    r = api.client.get("/v1/models", headers={"authorization": f"Bearer {api.key(mine)}"})
    ids = {m["id"] for m in r.json()["data"]}
    assert r.json()["object"] == "list"
    assert {"synthetic:tiny", "helper"} <= ids and "secret" not in ids


def test_a_catalog_model_the_engine_does_not_serve_is_not_listed_and_answers_404(api, peft_dirs):
    tenant = api.tenant()
    ghost = f"ghost-{tenant}"
    assert api.client.post("/admin/api/models", json={"name": ghost}, headers=api.admin).status_code == 201
    assert api.adapter(tenant, "haunt", peft_dirs[0], base_model=ghost).status_code == 400  # nothing to check it on
    key = api.key(tenant)
    auth = {"authorization": f"Bearer {key}"}
    ids = {m["id"] for m in api.client.get("/v1/models", headers=auth).json()["data"]}
    assert "synthetic:tiny" in ids and ghost not in ids
    _error(api.client.get(f"/v1/models/{ghost}", headers=auth), 404, "model_not_found", "model")
    _error(api.chat(key, model=ghost), 404, "model_not_found", "model")
    assert api.client.get("/v1/models/synthetic:tiny", headers=auth).json()["id"] == "synthetic:tiny"


def test_adapter_resolution_in_the_callers_tenant_only(api, peft_dirs):
    mine, other = api.tenant("mine"), api.tenant("other")
    assert api.adapter(mine, "tuned", peft_dirs[0]).status_code == 201
    assert api.adapter(other, "private", peft_dirs[1]).status_code == 201
    key = api.key(mine)
    base = api.chat(key, "same prompt", max_tokens=12).json()["choices"][0]["message"]["content"]
    by_name = api.chat(key, "same prompt", max_tokens=12, model="tuned")
    qualified = api.chat(key, "same prompt", max_tokens=12, model="synthetic:tiny:tuned")
    assert by_name.status_code == qualified.status_code == 200, by_name.text
    assert by_name.json()["choices"][0]["message"]["content"] == qualified.json()["choices"][0]["message"]["content"]
    assert by_name.json()["choices"][0]["message"]["content"] != base
    foreign = api.chat(key, model="private")
    missing = api.chat(key, model="nothere")
    assert foreign.status_code == missing.status_code == 404
    assert foreign.json()["error"]["message"].replace("private", "X") == \
        missing.json()["error"]["message"].replace("nothere", "X")
    assert foreign.json()["error"]["code"] == "model_not_found"
    _error(api.chat(key, model="synthetic:tiny:private"), 404, "model_not_found", "model")
    _error(api.chat(key, model="other-base:tuned"), 404, "model_not_found", "model")


def test_key_scopes_hide_models_and_adapters(api, peft_dirs):
    tenant = api.tenant()
    assert api.adapter(tenant, "allowed", peft_dirs[0]).status_code == 201
    assert api.adapter(tenant, "hidden", peft_dirs[1]).status_code == 201
    key = api.key(tenant, allowed_adapters=["allowed"])
    assert api.chat(key, model="allowed").status_code == 200
    _error(api.chat(key, model="hidden"), 404, "model_not_found")
    no_models = api.key(tenant, allowed_models=["some-other-model"])
    _error(api.chat(no_models), 404, "model_not_found")
    _error(api.chat(no_models, model="allowed"), 404, "model_not_found")


def test_priority_is_capped_by_the_key_and_salt_comes_from_the_tenant(api):
    t1, t2 = api.tenant(), api.tenant()
    standard, realtime, other = api.key(t1), api.key(t1, max_priority="realtime"), api.key(t2)
    recorded = api.backend.engine.requests

    def sent(key, **headers):
        r = api.post("/v1/chat/completions", key, {"model": "synthetic:tiny", "max_tokens": 1, "cache_salt": "mine",
                                                    "messages": [{"role": "user", "content": "p"}]}, **headers)
        assert r.status_code == 200, r.text
        return recorded[-1]

    assert sent(standard).priority == "standard"
    assert sent(standard, **{"x-priority": "realtime"}).priority == "standard"  # never raised
    assert sent(standard, **{"x-priority": "batch"}).priority == "batch"
    assert sent(realtime).priority == "realtime"
    assert sent(realtime, **{"x-priority": "standard"}).priority == "standard"
    salts = {sent(standard).cache_salt, sent(realtime).cache_salt}
    assert len(salts) == 1 and "mine" not in salts
    assert sent(other).cache_salt not in salts
    bad = api.post("/v1/chat/completions", standard, {"model": "synthetic:tiny", "messages": [{"role": "user",
                   "content": "p"}]}, **{"x-priority": "urgent"})
    _error(bad, 400, "invalid_value", "x-priority")


def test_every_request_emits_one_usage_event(api):
    tenant = api.tenant()
    key = api.key(tenant)
    r = api.chat(key, max_tokens=4)
    event = next(e for e in api.usage.events if e.request_id == r.headers["x-request-id"])
    usage = r.json()["usage"]
    assert (event.tenant, event.model, event.adapter, event.status) == (tenant, "synthetic:tiny", None, "ok")
    assert event.prompt_tokens == usage["prompt_tokens"] and event.completion_tokens == usage["completion_tokens"]
    assert event.key_prefix == key[:12] and key not in repr(event)
    assert event.finish_reason in ("stop", "length") and event.latency_s >= 0
    refused = api.chat(key, max_tokens=0)
    assert refused.status_code == 400
    assert all(e.request_id != refused.headers["x-request-id"] for e in api.usage.events)


def test_retrieve_model_answers_like_resolution(api, peft_dirs):
    mine, other = api.tenant(), api.tenant()
    assert api.adapter(other, "theirs", peft_dirs[0]).status_code == 201
    headers = {"authorization": f"Bearer {api.key(mine)}"}
    found = api.client.get("/v1/models/synthetic:tiny", headers=headers)
    assert found.status_code == 200 and found.json()["id"] == "synthetic:tiny" and found.json()["object"] == "model"
    _error(api.client.get("/v1/models/theirs", headers=headers), 404, "model_not_found")


def test_top_k_and_min_p_reach_the_sampler(api):
    """top_k 1 and min_p 1 leave only the most likely token: any seed gives the greedy answer."""
    key = api.key(api.tenant())
    greedy = api.chat(key, max_tokens=6, temperature=0).json()["choices"][0]["message"]["content"]
    for seed in range(3):
        for narrow in ({"top_k": 1}, {"min_p": 1.0}):
            r = api.chat(key, max_tokens=6, temperature=1.5, seed=seed, **narrow)
            assert r.json()["choices"][0]["message"]["content"] == greedy, narrow
    wide = {api.chat(key, max_tokens=6, temperature=1.5, seed=s, top_k=-1).json()["choices"][0]["message"]["content"]
            for s in range(3)}
    assert wide != {greedy}  # (-1: no top-k, so the seeds differ)


def test_logit_bias_reaches_the_sampler_and_bad_maps_are_400(api):
    key = api.key(api.tenant())
    r = api.chat(key, max_tokens=5, logit_bias={"65": 100})  # the byte-level model's token 65 is "A"
    assert r.json()["choices"][0]["message"]["content"] == "AAAAA"
    _error(api.chat(key, logit_bias={"A": 1}), 400, "invalid_value", "logit_bias")
    _error(api.chat(key, logit_bias={"65": 101}), 400, "invalid_request", "logit_bias")
    _error(api.chat(key, logit_bias={"999999": 1}), 400, "invalid_request", "logit_bias")
