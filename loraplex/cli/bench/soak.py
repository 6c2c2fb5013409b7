"""`loraplex bench soak`: does one tenant's hostile traffic stall the others, and does a long run lose or leak anything?

It starts its own server on loopback (a scratch Postgres database and Redis prefix; synthetic:tiny, or the default
model with --default-model) with a few generated adapters and `auto`'s pool, then:

1. warm-up: each model and adapter once; then the baseline: the server's RSS and engine stats;
2. clean phase (--seconds): `--clients` well-behaved streaming clients, each looping over the base model and the
   adapters, keys of three priority classes and x-priority headers, hanging up on about one stream in eight after
   its first token;
3. hostile phase (--seconds): the same clients, plus one sender per hostile kind (soak_hostile.py) from another
   tenant and another loopback address (127.0.0.2), the bad keys from a third one (127.0.0.3: throttling bad keys by
   address is tested without it shutting out the well-behaved clients or the hostile tenant's other requests, which
   must reach the server to test anything);
4. settle: KV blocks and adapter slots must come back to the baseline, RSS is read again; then the server is stopped
   (SIGTERM: it drains and flushes its ledger) and its usage rows are counted.

Reported:
- completed requests, and well-behaved errors (there must be none);
- TTFT p50/p99 of the well-behaved requests per phase, and the hostile/clean p99 ratio (target <= 1.5);
- RSS drift from the baseline (target within 10%), and engine stats back at baseline;
- ledger rows against the request ids answered 200 (every one must have its row, and no other row may exist).
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from loraplex.cli.bench import soak_clients as sc
from loraplex.cli.bench.percentiles import percentile
from loraplex.cli.bench.soak_hostile import hostile_requests

TINY = "synthetic:tiny"
DEFAULT_MODEL = "smollm2-135m"
ADAPTERS = 4
MAX_LORAS = 2  # fewer slots than adapters: the soak also cycles adapters through the slots
HOSTILE_MAX_SENDS = 200  # per kind and phase
HOSTILE_INTERVAL_S = 0.25  # between one kind's sends: a steady hostile stream, not a CPU-saturating flood
SETTLE_S = 10.0


def serve_args(model: str) -> list[str]:
    """`loraplex serve` options: the model and fewer adapter slots than adapters (tiny: on the CPU)."""
    args = ["--model", model, "--max-loras", str(MAX_LORAS)]
    return [*args, "--device", "cpu", "--kv-cache-mb", "64"] if model == TINY else args


def run_soak_bench(seconds: float, clients: int, default_model: bool = False,
                   database_url: str = "postgresql://postgres@localhost:5432/postgres",
                   redis_url: str = "redis://localhost:6379/0") -> dict:
    """The whole soak on its own server (module doc); returns the report."""
    from loraplex.cli.bench.live_server import live_server

    model = DEFAULT_MODEL if default_model else TINY
    with tempfile.TemporaryDirectory() as tmp, \
            live_server(serve_args(model), database_server=database_url, redis_url=redis_url) as server:
        keys, adapters = _prepare(server, model, Path(tmp))
        report = asyncio.run(_soak(server, model, adapters, keys, seconds, clients))
        report["server_exit_code"] = server.stop()
        ledger = server.ledger_request_ids()
    report["ledger"] = _ledger(report.pop("_answered"), ledger)
    report["model"] = model
    print_table(report)
    return report


def _prepare(server, model: str, tmp: Path) -> tuple[dict[str, str], list[str]]:
    """Tenants `soak` (keys of each priority class, the adapters) and `hostile` (one key); `model`
    in auto's pool."""
    from loraplex.cli.bench.synthetic_adapters import model_config, write_adapter

    server.admin("POST", "/tenants", json={"name": "soak"})
    server.admin("POST", "/tenants", json={"name": "hostile"})
    keys = {cls: server.admin("POST", "/tenants/soak/keys", json={"name": cls, "max_priority": cls}).json()["key"]
            for cls in ("realtime", "standard", "batch")}
    keys["hostile"] = server.admin("POST", "/tenants/hostile/keys", json={"name": "h"}).json()["key"]
    config = model_config(model)
    names = []
    for i in range(ADAPTERS):
        path = write_adapter(tmp / f"a{i}", config, rank=8, seed=i)
        names.append(f"soak-a{i}")
        server.admin("POST", "/tenants/soak/adapters", json={"name": names[-1], "base_model": model, "path": str(path)})
    server.admin("PATCH", f"/models/{model}", json={"auto_max_complexity": 1.0})
    return keys, names


async def _soak(server, model: str, adapters: list[str], keys: dict[str, str], seconds: float, clients: int) -> dict:
    """Warm-up, baseline, clean phase, hostile phase, settle; the report without the ledger."""
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(base_url=server.base_url, limits=limits, timeout=sc.REQUEST_TIMEOUT_S) as http, \
            httpx.AsyncClient(base_url=server.base_url, timeout=sc.REQUEST_TIMEOUT_S,
                              transport=httpx.AsyncHTTPTransport(local_address="127.0.0.2")) as other, \
            httpx.AsyncClient(base_url=server.base_url, timeout=sc.REQUEST_TIMEOUT_S,
                              transport=httpx.AsyncHTTPTransport(local_address="127.0.0.3")) as stranger:
        models = (model, *adapters)
        crowd = [sc.Client(keys[("realtime", "standard", "batch")[i % 3]], models, 1 / 8, seed=i)
                 for i in range(clients)]
        warm = sc.Phase("warm-up", time.monotonic() + 120, len(models) * 2)
        await asyncio.gather(*(sc.well_behaved(http, sc.Client(keys["standard"], (m,), 0.0, seed=i), warm)
                               for i, m in enumerate(models * 2)))
        await _settled(http, server, None)
        baseline = {"rss_bytes": server.rss_bytes(), "engine": await _stats(http, server)}
        cap = max(100, int(seconds * 200))
        clean = sc.Phase("clean", time.monotonic() + seconds, cap)
        await asyncio.gather(*(sc.well_behaved(http, c, clean) for c in crowd))
        baseline["rss_after_clean_bytes"] = server.rss_bytes()
        kinds = hostile_requests(model)
        hostile = sc.Phase("hostile", time.monotonic() + seconds, cap + HOSTILE_MAX_SENDS * len(kinds))
        senders = [sc.hostile(stranger if h.bad_key else other, h, model, keys["hostile"], hostile,
                              HOSTILE_MAX_SENDS, HOSTILE_INTERVAL_S) for h in kinds]
        await asyncio.gather(*(sc.well_behaved(http, c, hostile) for c in crowd), *senders)
        settled = await _settled(http, server, baseline["engine"])
        end = {"rss_bytes": server.rss_bytes(), "engine": await _stats(http, server)}
    return _report(warm, clean, hostile, baseline, end, settled)


async def _stats(http: httpx.AsyncClient, server) -> dict:
    """GET /admin/api/engine/stats."""
    r = await http.get("/admin/api/engine/stats", headers={"authorization": f"Bearer {server.admin_token}"})
    r.raise_for_status()
    return r.json()


def _kept(stats: dict, keep: dict[str, tuple[str, ...]]) -> dict:
    """The figures `keep` names of an engine stats body, nested as it is."""
    return {part: {name: stats[part][name] for name in names} for part, names in keep.items()}


def _at_rest(stats: dict, baseline: dict | None) -> bool:
    """Nothing running or waiting, and (given a baseline) KV blocks and adapter slots back at it."""
    idle = stats["requests"]["running"] == 0 and stats["requests"]["waiting"] == 0
    if baseline is None:
        return idle
    return idle and stats["kv"]["blocks_used"] <= baseline["kv"]["blocks_used"] \
        and stats["adapters"]["loaded"] <= baseline["adapters"]["loaded"]


async def _settled(http: httpx.AsyncClient, server, baseline: dict | None) -> float | None:
    """Seconds until nothing runs or waits and KV/slots are back at `baseline`; None if not within SETTLE_S."""
    started = time.monotonic()
    while time.monotonic() - started < SETTLE_S:
        if _at_rest(await _stats(http, server), baseline):
            return round(time.monotonic() - started, 2)
        await asyncio.sleep(0.1)
    return None


def _percentiles(values: list[float]) -> dict:
    """p50 and p99 in ms."""
    if not values:
        return {"p50": None, "p99": None, "count": 0}
    return {"p50": round(percentile(values, 50) * 1000, 1), "p99": round(percentile(values, 99) * 1000, 1),
            "count": len(values)}


def _phase(p: sc.Phase) -> dict:
    """One phase's figures for the report."""
    out = {"requests": p.sent, "completed": p.completed, "disconnected": p.disconnected,
           "well_behaved_errors": len(p.errors), "errors_sample": p.errors[:10], "ttft_ms": _percentiles(p.ttft_s),
           "by_priority": dict(p.by_priority), "by_model": dict(p.by_model)}
    if p.hostile:
        out["hostile"] = {kind: {"outcomes": dict(c), "seconds_max": round(max(p.hostile_seconds[kind]), 2),
                                 "seconds_p50": round(statistics.median(p.hostile_seconds[kind]), 3),
                                 "first_body": p.hostile_samples[kind]}
                          for kind, c in sorted(p.hostile.items())}
    return out


def _report(warm, clean, hostile, baseline: dict, end: dict, settled: float | None) -> dict:
    """The report's figures (targets beside them)."""
    phases = {"clean": _phase(clean), "hostile": _phase(hostile)}
    p99s = [phases[k]["ttft_ms"]["p99"] for k in ("clean", "hostile")]
    rss0, rss1 = baseline["rss_bytes"], end["rss_bytes"]
    keep = {"requests": ("running", "waiting"), "kv": ("blocks_used", "blocks_free"), "adapters": ("loaded",)}
    return {
        "phases": phases,
        "completed": clean.completed + hostile.completed,
        "well_behaved_errors": len(clean.errors) + len(hostile.errors) + len(warm.errors),
        "ttft_p99_ratio": round(p99s[1] / p99s[0], 3) if all(p99s) else None,
        "rss": {"after_warmup_mb": round(rss0 / 2**20, 1),
                "after_clean_mb": round(baseline["rss_after_clean_bytes"] / 2**20, 1), "end_mb": round(rss1 / 2**20, 1),
                "drift_pct": round(100 * (rss1 - rss0) / rss0, 2) if rss0 else None},
        "engine": {"baseline": _kept(baseline["engine"], keep), "end": _kept(end["engine"], keep),
                   "back_at_baseline": settled is not None, "settle_seconds": settled},
        "targets": {"ttft_p99_ratio_max": 1.5, "rss_drift_pct_max": 10.0},
        "_answered": {**warm.answered, **clean.answered, **hostile.answered},
    }


def _ledger(answered: dict[str, int], rows: set[str]) -> dict:
    """Every request answered 200 has its usage row; a row for anything else must be a request that
    reached the engine and failed there (5xx: billed what it generated), never one refused before."""
    admitted = {rid for rid, status in answered.items() if status == 200}
    others = rows - admitted
    wrong = sorted(rid for rid in others if answered.get(rid, 0) < 500)
    return {"rows": len(rows), "completed_requests": len(admitted), "missing": sorted(admitted - rows)[:20],
            "rows_for_failed_requests": len(others) - len(wrong),
            "rows_for_failed_sample": {rid: answered.get(rid) for rid in sorted(others)[:20]},
            "rows_for_refused_or_unknown": wrong[:20], "equal": not (admitted - rows) and not wrong}


def print_table(r: dict) -> None:
    """The short table of the run."""
    rows = [("", "clean", "hostile")]
    for label, key in (("requests", "requests"), ("completed", "completed"), ("disconnected", "disconnected"),
                       ("well-behaved errors", "well_behaved_errors")):
        rows.append((label, *(str(r["phases"][p][key]) for p in ("clean", "hostile"))))
    for q in ("p50", "p99"):
        rows.append((f"TTFT {q} ms", *(str(r["phases"][p]["ttft_ms"][q]) for p in ("clean", "hostile"))))
    width = max(len(row[0]) for row in rows)
    for row in rows:
        print(f"{row[0]:<{width}}  {row[1]:>10}  {row[2]:>10}")
    print(f"TTFT p99 hostile/clean: {r['ttft_p99_ratio']} (target <= 1.5)")
    rss = r["rss"]
    print(f"RSS: {rss['after_warmup_mb']} -> {rss['after_clean_mb']} (after clean) -> {rss['end_mb']} MB "
          f"({rss['drift_pct']}%, target within 10%)")
    print(f"engine back at baseline: {r['engine']['back_at_baseline']} {r['engine']['end']}")
    print(f"ledger rows {r['ledger']['rows']} / requests answered 200 {r['ledger']['completed_requests']} "
          f"(+{r['ledger']['rows_for_failed_requests']} failed in the engine): "
          f"{'no loss' if r['ledger']['equal'] else 'MISMATCH'}")
    for kind, h in r["phases"]["hostile"].get("hostile", {}).items():
        print(f"  hostile {kind}: {h['outcomes']} (max {h['seconds_max']} s)")
