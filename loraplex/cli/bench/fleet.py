"""Adapter-affinity routing against Ray Serve's default routing, over a Ray Serve deployment of engine replicas.

- Setup: one local Ray cluster starts in this process. `replicas` engine replicas (each on `threads` threads, so
  together they use this machine's cores; the cluster's CPUs shared among them) each hold few adapters: `max_loras`
  device slots and a CPU tier of `max_cpu_loras`.
- Load: requests for `adapters` rank-`rank` adapters, picked uniformly at random (or, with `popularity` zipf:<s>,
  adapter k with weight 1 / (k + 1)^s), kept `concurrency` in flight, each prepared and generated through
  RayEngineClient, as the platform does.
- Policies:
  - affinity: AffinityRouter (loraplex/ray_serve/router.py): an adapter's requests on its rendezvous replica, within
    a load bound.
  - serve_default: Serve's default router (power of two choices, preferring replicas that have reported holding the
    request's adapter, which they do seconds after its first requests): Serve's own multiplexing affinity.
  - serve_untagged: Serve's default router over requests that carry no multiplexed id: placement by load alone, what
    a deployment without adapter affinity gets (the issue's baseline).
- The policies take turns, `rounds` times. Each turn deploys the application afresh (deleted after the turn, so the
  replicas start cold), warms its replicas with a few base-model requests, and registers its adapters under new ids.
- Reported per policy, over all its turns: tokens/s, TTFT p50 and p95 (from before prepare), and per request the
  adapter loads into device slots and those of them read from disk (not the CPU tier), summed over the replicas; per
  turn the requests each replica started, the adapters registered on each, and the steps of all.
- `ratios` puts affinity over each other policy (tokens/s) and each over affinity (TTFT); `targets` sets the issue's
  targets (for 2 replicas, 24 adapters, 4 slots each, 16 in flight) beside the figures: recorded, not asserted.
- `hop`: what the Serve hop itself costs. One replica serves HOP_MODEL (tiny: its compute is negligible), and the same
  model runs in this process; `hop_requests` requests, one at a time, taking turns between the two, each prepared and
  generated, with 1 new token and with HOP_TOKENS; p50 latency of each side, and the difference per request and per
  further token.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import random
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from loraplex.cli.bench.lora import adapter_path, make_adapters, zipf_choices
from loraplex.cli.engine_args import ENGINE_OPTIONS, build_engine
from loraplex.engine.api import EngineClient, GenerateRequest, SamplingParams
from loraplex.engine.models.loader import load_model, resolve_model

POLICIES = ("affinity", "serve_default", "serve_untagged")
HOP_MODEL, HOP_TOKENS = "synthetic:tiny", 32
WARMUP_REQUESTS = 8  # base-model requests, each under its own affinity key, so every replica runs some
# the targets, as (figure, bound): at_least or at_most
TARGETS = {"ttft_p50_serve_untagged_vs_affinity": ("at_least", 2.0),
           "tok_s_affinity_vs_serve_untagged": ("at_least", 1.0),
           "hop_added_ms_per_request": ("at_most", 3.0), "hop_added_ms_per_token": ("at_most", 0.1)}


def _engine_factory(model: str, threads: int, kv_cache_mb: int, **options) -> Callable[[], EngineClient]:
    """What each replica builds its engine from, as `serve --ray` passes it: fp32 on the CPU, no speculation."""
    given = {"model": [model], "device": "cpu", "dtype": "float32", "threads": threads, "kv_cache_mb": kv_cache_mb,
             "speculative_tokens": 0, **options}
    return functools.partial(build_engine, argparse.Namespace(**{name: given.get(name) for name in ENGINE_OPTIONS}))


@contextlib.asynccontextmanager
async def _deployment(plan, factory: Callable[[], EngineClient]) -> AsyncIterator:
    """The replicas' application, deployed for the block and deleted after it (the next one starts cold)."""
    from ray import serve

    from loraplex.ray_serve.deploy import APP_NAME, deploy

    client = await asyncio.to_thread(deploy, "auto", plan, factory)
    try:
        yield client
    finally:
        await client.close()
        await asyncio.to_thread(serve.delete, APP_NAME)


async def _send(engine: EngineClient, request: GenerateRequest) -> tuple[float | None, float, int]:
    """Prepared and generated, as the platform does: (seconds to the first token, seconds in all, tokens)."""
    t0, first, tokens = time.perf_counter(), None, 0
    async for event in engine.generate(await engine.prepare(request)):
        if event.token_ids and first is None:
            first = time.perf_counter() - t0
        tokens += len(event.token_ids)
    return first, time.perf_counter() - t0, tokens


async def _turn(client, tag: str, paths: list[Path], choices: list[int], model: str, new_tokens: int,
                concurrency: int) -> dict:
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    await asyncio.gather(*(_send(client, GenerateRequest(f"{tag}-warm{i}", model, prompt="warm up", sampling=warm,
                                                         cache_salt=f"{tag}-warm{i}")) for i in range(WARMUP_REQUESTS)))
    ids = [f"{tag}-a{k}" for k in range(len(paths))]
    for adapter_id, path in zip(ids, paths, strict=True):
        await asyncio.to_thread(client.add_adapter, adapter_id, str(path), model)
    await client.poll()
    before, started = client.stats(), {r.replica: r.requests for r in client.replicas()}
    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int, k: int) -> tuple[float | None, float, int]:
        async with gate:
            return await _send(client, GenerateRequest(f"{tag}-{i}", model, sampling=sp, adapter=ids[k],
                                                       prompt=f"Write a short note about topic number {i}."))

    t0 = time.perf_counter()
    sent = await asyncio.gather(*(one(i, k) for i, k in enumerate(choices)))
    wall = time.perf_counter() - t0
    await client.poll()
    after, replicas = client.stats(), sorted(client.replicas(), key=lambda r: r.replica)
    return {"tokens": sum(tokens for _, _, tokens in sent), "seconds": round(wall, 3),
            "ttfts": [first for first, _, _ in sent if first is not None],
            "adapter_loads": after.adapters.loads - before.adapters.loads,
            "disk_loads": after.adapters.disk_loads - before.adapters.disk_loads,
            "merges": after.adapters.merges - before.adapters.merges,
            "requests_per_replica": [r.requests - started.get(r.replica, 0) for r in replicas],
            "adapters_per_replica": [len(r.adapters) for r in replicas],
            "steps": after.requests.num_steps - before.requests.num_steps}


async def _hop(replica: EngineClient, local: EngineClient, count: int) -> dict:
    result: dict = {"model": HOP_MODEL, "requests": count}
    for tokens in (1, HOP_TOKENS):
        sp = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        sides: dict[str, list[float]] = {"in_process": [], "replica": []}
        for i in range(count + 3):  # the first 3 of each side warm up
            for side, engine in (("in_process", local), ("replica", replica)):
                rid = f"hop-{side}-{tokens}-{i}"
                _, took, _ = await _send(engine, GenerateRequest(rid, HOP_MODEL, prompt=f"a short prompt {rid}",
                                                                 sampling=sp))
                if i >= 3:
                    sides[side].append(took)
        result[f"{tokens}_tokens"] = {f"{side}_p50_ms": round(statistics.median(v) * 1000, 3)
                                      for side, v in sides.items()}
    one, many = result["1_tokens"], result[f"{HOP_TOKENS}_tokens"]
    added = {n: r["replica_p50_ms"] - r["in_process_p50_ms"] for n, r in ((1, one), (HOP_TOKENS, many))}
    result["added_ms_per_request"] = round(added[1], 3)
    result["added_ms_per_token"] = round((added[HOP_TOKENS] - added[1]) / (HOP_TOKENS - 1), 4)
    return result


async def _measure_hop(plan, threads: int, count: int) -> dict:
    factory = _engine_factory(HOP_MODEL, threads, 16)
    local = factory()
    try:
        async with _deployment(plan, factory) as client:
            return await _hop(client, local, count)
    finally:
        local.shutdown()


def _summary(turns: list[dict], requests: int) -> dict:
    ttfts = sorted(t for turn in turns for t in turn["ttfts"])
    per_request = {key: round(sum(t[key] for t in turns) / (requests * len(turns)), 3)
                   for key in ("adapter_loads", "disk_loads")}
    return {
        "tok_s": round(sum(t["tokens"] for t in turns) / sum(t["seconds"] for t in turns), 2),
        "ttft_p50_ms": round(statistics.median(ttfts) * 1000, 1),
        "ttft_p95_ms": round(ttfts[int(0.95 * (len(ttfts) - 1))] * 1000, 1),
        **{key: sum(t[key] for t in turns) for key in ("adapter_loads", "disk_loads", "merges")},
        **{f"{key}_per_request": value for key, value in per_request.items()},
        "rounds_tok_s": [round(t["tokens"] / t["seconds"], 2) for t in turns],
        **{f"rounds_{key}": [t[key] for t in turns]
           for key in ("requests_per_replica", "adapters_per_replica", "steps", "seconds")},
    }


def _targets(ratios: dict, hop: dict | None) -> dict:
    """The issue's targets beside the figures (None where not measured)."""
    figures = dict(ratios)
    if hop is not None:
        figures.update({f"hop_{key}": hop[key] for key in ("added_ms_per_request", "added_ms_per_token")})
    out = {}
    for name, (bound, value) in TARGETS.items():
        measured = figures.get(name)
        met = None if measured is None else (measured >= value if bound == "at_least" else measured <= value)
        out[name] = {bound: value, "measured": measured, "met": met}
    return out


def _choices(popularity: str, requests: int, adapters: int) -> list[int]:
    if popularity == "uniform":
        return random.Random(0).choices(range(adapters), k=requests)
    if popularity.startswith("zipf:"):
        with contextlib.suppress(ValueError):
            return zipf_choices(requests, adapters, float(popularity[5:]))
    raise ValueError(f"--popularity is uniform or zipf:<s>, got {popularity!r}")


def _check_counts(**counts: int) -> None:
    """Every count positive (hop_requests may be 0), else one line naming the option."""
    for name, value in counts.items():
        low = 0 if name == "hop_requests" else 1
        if value < low:
            raise ValueError(f"--{name.replace('_', '-')} must be at least {low}, got {value}")


def run_fleet_bench(model: str, replicas: int, threads: int | None, adapters: int, rank: int, requests: int,
                    concurrency: int, new_tokens: int, max_loras: int, max_cpu_loras: int, rounds: int,
                    hop_requests: int = 100, popularity: str = "uniform") -> dict:
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // max(1, replicas))
    _check_counts(replicas=replicas, threads=threads, adapters=adapters, rank=rank, requests=requests,
                  concurrency=concurrency, new_tokens=new_tokens, max_loras=max_loras, max_cpu_loras=max_cpu_loras,
                  rounds=rounds, hop_requests=hop_requests)
    choices = _choices(popularity, requests, adapters)
    import ray
    from ray import serve

    from loraplex.ray_serve.deploy import ReplicaPlan, connect_cluster
    from loraplex.ray_serve.router import SLACK

    ReplicaPlan(replicas=replicas)  # (its bounds, in one line, before a cluster starts)
    factory = _engine_factory(model, threads, 256, max_loras=max_loras, max_cpu_loras=max_cpu_loras, max_lora_rank=rank)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_adapters(load_model(resolve_model(model)), root, adapters, rank)
        paths = [adapter_path(root, k) for k in range(adapters)]
        connect_cluster("auto")
        try:
            serve.start(proxy_location="Disabled")  # (the handle is the path measured: no HTTP proxy, no port taken)
            cpus = ray.cluster_resources()["CPU"]
            plans = {p: ReplicaPlan(replicas=replicas, num_cpus=cpus / replicas, affinity=p == "affinity",
                                    tagged=p != "serve_untagged") for p in POLICIES}
            turns: dict[str, list[dict]] = {p: [] for p in POLICIES}

            async def main() -> dict | None:
                for r in range(rounds):
                    for policy in POLICIES if r % 2 == 0 else reversed(POLICIES):
                        async with _deployment(plans[policy], factory) as client:
                            turns[policy].append(await _turn(client, f"{policy}-{r}", paths, choices, model,
                                                             new_tokens, concurrency))
                if not hop_requests:
                    return None
                return await _measure_hop(ReplicaPlan(replicas=1, num_cpus=min(threads, cpus)), threads, hop_requests)

            hop = asyncio.run(main())
        finally:
            serve.shutdown()
            ray.shutdown()
    results = {"model": model, "replicas": replicas, "threads_per_replica": threads,
               "cpus_per_replica": round(cpus / replicas, 3), "adapters": adapters, "popularity": popularity,
               "adapters_used": len(set(choices)), "rank": rank,
               "requests": requests, "concurrency": concurrency, "new_tokens": new_tokens, "max_loras": max_loras,
               "max_cpu_loras": max_cpu_loras, "rounds": rounds, "slack": SLACK, "ray": ray.__version__,
               "policies": {p: _summary(turns[p], requests) for p in POLICIES}}
    if hop is not None:
        results["hop"] = hop
    a = results["policies"]["affinity"]
    results["ratios"] = {}
    for other in POLICIES[1:]:
        b = results["policies"][other]
        results["ratios"] |= {f"tok_s_affinity_vs_{other}": round(a["tok_s"] / b["tok_s"], 3),
                              f"ttft_p50_{other}_vs_affinity": round(b["ttft_p50_ms"] / a["ttft_p50_ms"], 3)}
    results["targets"] = _targets(results["ratios"], hop)
    return results
