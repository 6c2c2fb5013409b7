"""schemathesis over the real server's OpenAPI (/schema/openapi.json): the tenant API (/v1) with a valid
tenant key and the admin API (/admin/api) with the admin token, bounded to a few hundred cases.

Held to: no 5xx, and every error body in the documented {"error": {"message", "type", "param",
"code"}} format (loraplex/cli/bench/fuzz_checks.py). The harness is `loraplex bench fuzz`'s
(loraplex/cli/bench/fuzz.py), run here on the real server process with the synthetic tiny model, a
128-token context (so no max_tokens the fuzzer sends makes a long generation) and a tenant default of
16 tokens.

No operation is excluded. Three would end the run if they were given the fuzz tenant's own names:
POST /admin/api/tenants/{name}/disable (the tenant's key stops working), POST
/admin/api/keys/{prefix}/revoke (the key is revoked) and DELETE /admin/api/tenants/{name}/adapters/
{adapter} (the adapter the generations use is gone); they are fuzzed with generated and nasty names
only (NUL, control characters, a trailing newline...: fuzz.NASTY), while the other operations also
get the real names.
"""

from __future__ import annotations

import json
import os

from loraplex.cli.bench.fuzz import SERVE_ARGS, prepare_target, run_fuzz
from loraplex.cli.bench.live_server import PG_SERVER, REDIS, live_server

CASES = 320


def test_schemathesis_finds_no_server_error_and_only_openai_shaped_errors(tmp_path):
    with live_server(SERVE_ARGS, database_server=os.environ.get("LORAPLEX_TEST_DATABASE_URL", PG_SERVER),
                     redis_url=os.environ.get("LORAPLEX_TEST_REDIS_URL", REDIS)) as server:
        target = prepare_target(server.base_url, server.admin_token, tmp_path)
        report = run_fuzz(target, CASES, server_output=server.output_since)
        alive = server.proc.poll() is None
    assert alive, "\n".join(server.output[-50:])
    assert report["cases"] >= 300
    operations = report["by_operation"]
    assert any(op.startswith("POST /v1/chat") for op in operations) and any("/admin/api/" in op for op in operations)
    # the fuzzer reached past validation: some generations were served
    assert sum(operations[f"POST /v1/{op}"]["statuses"].get("200", 0) for op in ("chat/completions", "completions"))
    assert report["failed_cases"] == 0, json.dumps(
        {"failures": report["failure_signatures"], "distinct": report["distinct_failures"]},
        indent=1, ensure_ascii=False)[:30_000]
