"""However a request ends (engine error, a stream that raises, an engine abort, a timeout, an
engine that refuses it, a client that leaves), its reservation is released and what it actually
used is charged: the counters equal the ledger and nothing stays reserved."""

from __future__ import annotations

import json

import pytest

from tests.integration.billing_support import (
    FAKE_MODEL,
    FAKE_PROMPT_TOKENS,
    ScriptedEngine,
    app_client,
    assert_counters_match_ledger,
    complete,
    in_app,
    new_tenant,
    platform_of,
    set_budget,
)


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize(("ending", "status", "code", "ledger_status"), [
    ("stop", 200, None, "ok"),
    ("error", 503, "generation_failed", "error"),
    ("raise", 503, "generation_failed", "error"),
    ("abort", 503, "generation_failed", "aborted"),
    ("hang", 504, "request_timeout", "timeout"),
])
def test_every_ending_charges_what_was_generated_and_releases_the_rest(postgres_backend, ending, status, code,
                                                                       ledger_status, n, caplog):
    """With n choices, one choice's failure fails the request: the others are stopped, and what all
    of them generated is charged, the prompt once."""
    engine = ScriptedEngine(ending, tokens=3)
    # Only the hanging engine meets the timeout. It counts from the request's arrival (auth, first
    # database reads), so a short one could cut the other endings short on a slow machine.
    with app_client(postgres_backend, engine, request_timeout_s=2.0 if ending == "hang" else 0.0) as client:
        tenant, tenant_id, key = new_tenant(client, f"end-{ending}")
        set_budget(client, tenant, 1000)
        for stream in (False, True):
            r = complete(client, key, FAKE_MODEL, max_tokens=50, stream=stream, n=n)
            if stream:
                assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
                if code:
                    assert json.loads(r.text.split("\n\n")[-3][len("data: "):])["error"]["code"] == code
            else:
                assert r.status_code == status, r.text
                assert code is None or r.json()["error"]["code"] == code
        rows = assert_counters_match_ledger(client, tenant, tenant_id)
        assert [(r.status, r.prompt_tokens) for r in rows] == [(ledger_status, FAKE_PROMPT_TOKENS)] * 2
        for row in rows:  # a failure may stop the other choices before their last tokens
            assert row.completion_tokens == 3 * n if ending == "stop" else 3 <= row.completion_tokens <= 3 * n
        if ending in ("raise", "hang"):  # the engine was told to stop every choice of the request
            ids = [r.request_id if n == 1 else f"{r.request_id}-{i}" for r in rows for i in range(n)]
            assert set(ids) <= set(engine.aborted)
        if ending == "error":  # the tenant sees a generic 503; the operator's log has the engine's reason
            assert sum("failed in the engine: boom" in m for m in caplog.messages) == 2


def test_an_engine_that_refuses_charges_nothing(postgres_backend):
    with app_client(postgres_backend, ScriptedEngine("refuse")) as client:
        tenant, tenant_id, key = new_tenant(client, "refused")
        set_budget(client, tenant, 1000)
        assert complete(client, key, FAKE_MODEL).status_code == 500
        assert assert_counters_match_ledger(client, tenant, tenant_id) == []
        assert len(platform_of(client).quota.tail) == 0


@pytest.mark.parametrize("n", [1, 3])
def test_a_client_that_leaves_mid_stream_is_charged_what_was_generated(postgres_backend, n):
    """The disconnect itself: GenerationRun.close() with the stream left early, as Litestar does;
    every choice's engine request is stopped."""
    engine = ScriptedEngine("hang", tokens=2)
    with app_client(postgres_backend, engine) as client:
        tenant, tenant_id, key = new_tenant(client, "leaver")
        set_budget(client, tenant, 1000)
        platform = platform_of(client)

        async def leave_after_two_tokens():
            from loraplex.platform.openai.formatting import TextFormat, stream

            run = await _run(platform, key, n)
            body = stream(run, [TextFormat("x", 0, FAKE_MODEL, index=i) for i in range(n)], False)
            got = [await anext(body) for _ in range(2)]
            await body.aclose()  # what Litestar does when the client is gone
            return got, run.status

        got, status = in_app(client, leave_after_two_tokens)
        assert len(got) == 2 and status == "client_disconnected"
        rows = assert_counters_match_ledger(client, tenant, tenant_id)
        assert [(r.status, r.completion_tokens) for r in rows] == [("client_disconnected", 2)]
        rid = rows[0].request_id
        assert set(engine.aborted) == ({rid} if n == 1 else {f"{rid}-{i}" for i in range(n)})


async def _run(platform, key, n=1):
    """A started GenerationRun for a 50-token request of `key` with n choices, admitted as the API would."""
    import secrets
    import time

    from loraplex.billing.usage import utcnow
    from loraplex.engine.api import GenerateRequest, SamplingParams
    from loraplex.platform.openai.generation import GenerationRun
    from loraplex.platform.routing.resolution import Target

    principal = await platform.auth.authenticate(f"Bearer {key}")
    request = GenerateRequest(f"req_{secrets.token_hex(12)}", FAKE_MODEL, prompt="hello",
                              sampling=SamplingParams(max_tokens=50))
    ticket = await platform.admission.admit(principal, request.request_id, utcnow(), FAKE_PROMPT_TOKENS, 50 * n)
    run = GenerationRun(platform.runs, request, principal, Target(FAKE_MODEL, FAKE_MODEL), ticket,
                        FAKE_PROMPT_TOKENS, "/v1/completions", time.perf_counter(), utcnow(), n=n)
    run.start()
    return run
