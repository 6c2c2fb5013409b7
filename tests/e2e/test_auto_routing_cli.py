"""`model: "auto"` on the real `loraplex serve` (embedded SQLite, two base models) under the
`openai` client, with auto's pool set by `loraplex models route` from another process (scored by
the heuristic, and `models score` reads the same LORAPLEX_ROUTER)."""

from __future__ import annotations

import json
import time

import openai

from tests.e2e.server import start
from tests.e2e.test_cli_platform import EMBEDDED, loraplex, one_line_error

SMALL, LARGE = "synthetic:tiny:2", "synthetic:tiny"
COMPLEX = "```\nf(x)\n```\nProve it halts, compare and justify"


def ask(client: openai.OpenAI, content: str):
    raw = client.chat.completions.with_raw_response.create(
        model="auto", messages=[{"role": "user", "content": content}], max_tokens=4, temperature=0)
    return raw.parse(), raw.headers


def test_models_route_sets_the_pool_auto_chooses_from(tmp_path):
    env = {**EMBEDDED, "LORAPLEX_DATA_DIR": str(tmp_path), "LORAPLEX_ROUTER": "heuristic"}  # scores we can name
    server = start(env, "--model", SMALL, "--no-demo")
    try:
        assert loraplex(env, "tenants", "create", "router").returncode == 0
        key = loraplex(env, "keys", "create", "--tenant", "router").stdout.strip().splitlines()[-1]
        client = openai.OpenAI(api_key=key, base_url=f"{server.base_url}/v1", max_retries=0, timeout=60)
        assert "auto" not in {m.id for m in client.models.list()}

        for model, limit in ((SMALL, "0.3"), (LARGE, "1")):
            out = loraplex(env, "models", "route", model, "--max-complexity", limit)
            assert out.returncode == 0 and f"up to complexity {limit}" in out.stdout, out
        listed = json.loads(loraplex(env, "models", "list", "--json").stdout)
        assert {"name": SMALL, "source": SMALL, "auto_max_complexity": 0.3} in listed
        assert {"name": LARGE, "source": LARGE, "auto_max_complexity": 1.0} in listed

        deadline = time.monotonic() + 15  # the server re-reads the catalog within its cache's TTL
        while "auto" not in {m.id for m in client.models.list()}:
            assert time.monotonic() < deadline, "auto never listed"
            time.sleep(0.2)
        simple, headers = ask(client, "Hello")
        assert simple.model == headers["x-loraplex-model"] == SMALL and headers["x-loraplex-complexity"] == "0.0000"
        hard, headers = ask(client, COMPLEX)
        assert hard.model == LARGE and float(headers["x-loraplex-complexity"]) > 0.3
        assert hard.usage.completion_tokens > 0
        scored = loraplex(env, "models", "score", "--prompt", COMPLEX, "--max-tokens", "4")
        assert scored.returncode == 0 and scored.stdout.splitlines()[0] == f"score\t{headers['x-loraplex-complexity']}"
        assert "code\t1.00 x 0.25" in scored.stdout  # the fenced block

        one_line_error(loraplex(env, "models", "route", "nope", "--max-complexity", "0.5"), "not registered")
        one_line_error(loraplex(env, "models", "route", SMALL, "--max-complexity", "2"), "from 0 to 1")
        one_line_error(loraplex(env, "models", "route", SMALL, "--max-complexity", "high"), "from 0 to 1")
        one_line_error(loraplex(env, "models", "add", "auto"), "reserved")
        assert loraplex(env, "models", "route", LARGE, "--off").returncode == 0
        deadline = time.monotonic() + 15
        while ask(client, COMPLEX)[0].model != SMALL:  # the only model left: the most capable there is
            assert time.monotonic() < deadline, "the large model stayed in the pool"
            time.sleep(0.2)
    finally:
        server.stop()
