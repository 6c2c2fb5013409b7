"""Adapter-affinity placement against least-loaded balancing, over real engine workers, in one run.

`workers` `loraplex worker` processes (each on `threads` threads, so together they use this
machine's cores) each hold few adapters: `max_loras` device slots and a CPU tier of
`max_cpu_loras`. Requests for `adapters` rank-`rank` adapters, picked uniformly at random (or, with
`popularity` zipf:<s>, adapter k with weight 1 / (k + 1)^s), are kept `concurrency` in flight.
Under least_loaded every worker sees every adapter, so the tiers thrash and steps mix more adapters;
under affinity each worker sees its share. The policies take turns, `rounds` times, each turn on the
same workers with its adapters registered afresh (cold: new ids).

Reported per policy, over all its turns: tokens/s, TTFT p50 and p95, and per request the adapter loads
into device slots and those of them read from disk (not the CPU tier); `ratios` puts affinity over
least_loaded (tokens/s) and least_loaded over affinity (TTFT).

`hop`: what the worker hop itself costs. One more worker serves HOP_MODEL (tiny: its compute is
negligible), and the same model runs in this process; `hop_requests` requests, one at a time, taking
turns between the two, each prepared (`prepare`: validated and tokenized, as the platform does) and generated,
with 1 new token and with HOP_TOKENS; p50 latency of each side, and the difference per request and
per further token.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from loraplex.cli.bench.lora import adapter_path, make_adapters, zipf_choices
from loraplex.engine.api import EngineClient, GenerateRequest, SamplingParams
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.config import EngineConfig
from loraplex.engine.models.loader import load_model, resolve_model
from loraplex.fleet.fleet import EngineFleet
from loraplex.fleet.placement import POLICIES
from loraplex.fleet.remote import RemoteWorker


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_workers(count: int, options: list[str], timeout_s: float = 600) -> list[tuple[subprocess.Popen, str]]:
    started = []
    for _ in range(count):
        port = _free_port()
        cmd = [sys.executable, "-m", "loraplex.cli.main", "worker", *options, "--port", str(port),
               "--log-level", "warning"]
        started.append((subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True),
                        f"http://127.0.0.1:{port}"))
    deadline = time.monotonic() + timeout_s
    for proc, url in started:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"worker {url} exited: {proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(f"{url}/engine/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"worker {url} not ready in {timeout_s:.0f} s")
            time.sleep(0.5)
    return started


async def _turn(fleet: EngineFleet, policy: str, tag: str, paths: list[Path], choices: list[int], model: str,
                new_tokens: int, concurrency: int) -> dict:
    fleet.policy = policy
    ids = [f"{tag}-a{k}" for k in range(len(paths))]
    for adapter_id, path in zip(ids, paths, strict=True):
        await asyncio.to_thread(fleet.add_adapter, adapter_id, str(path), model)
    await fleet.poll()
    before, routed = fleet.stats(), dict(fleet.routed)
    steps_before = {u: h.stats.num_steps for u, h in fleet.health.items()}
    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    gate = asyncio.Semaphore(concurrency)
    ttfts: list[float] = []

    async def one(i: int, k: int) -> int:
        req = GenerateRequest(f"{tag}-{i}", model, prompt=f"Write a short note about topic number {i}.",
                              sampling=sp, adapter=ids[k])
        async with gate:
            t0, tokens = time.perf_counter(), 0
            async for event in fleet.generate(req):
                if event.token_ids and not tokens:
                    ttfts.append(time.perf_counter() - t0)
                tokens += len(event.token_ids)
            return tokens

    t0 = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(i, k) for i, k in enumerate(choices))))
    wall = time.perf_counter() - t0
    await fleet.poll()
    after = fleet.stats()
    held = [sum(1 for _, a in fleet.registered(u) if a in ids) for u in fleet.workers]
    steps = [h.stats.num_steps - steps_before[u] for u, h in fleet.health.items()]
    for adapter_id in ids:
        await fleet.remove_adapter(adapter_id, model)
    return {"tokens": tokens, "seconds": round(wall, 3), "ttfts": ttfts,
            "adapter_loads": after.adapter_loads - before.adapter_loads,
            "disk_loads": after.adapter_disk_loads - before.adapter_disk_loads,
            "merges": after.adapter_merges - before.adapter_merges,
            "requests_per_worker": [fleet.routed[u] - routed.get(u, 0) for u in fleet.workers],
            "adapters_per_worker": held, "steps_per_worker": steps}


HOP_MODEL, HOP_TOKENS = "synthetic:tiny", 32


async def _hop(fleet: EngineFleet, local: EngineClient, count: int) -> dict:
    async def latency(engine: EngineClient, rid: str, tokens: int) -> float:
        req = GenerateRequest(rid, HOP_MODEL, prompt=f"a short prompt {rid}",
                              sampling=SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
        t0 = time.perf_counter()
        req = await engine.prepare(req)
        async for _ in engine.generate(req):
            pass
        return time.perf_counter() - t0

    result: dict = {"model": HOP_MODEL, "requests": count}
    for tokens in (1, HOP_TOKENS):
        sides: dict[str, list[float]] = {"in_process": [], "worker": []}
        for i in range(count + 3):  # the first 3 of each side warm up
            for side, engine in (("in_process", local), ("worker", fleet)):
                took = await latency(engine, f"hop-{side}-{tokens}-{i}", tokens)
                if i >= 3:
                    sides[side].append(took)
        result[f"{tokens}_tokens"] = {f"{side}_p50_ms": round(statistics.median(v) * 1000, 3)
                                      for side, v in sides.items()}
    one, many = result["1_tokens"], result[f"{HOP_TOKENS}_tokens"]
    added = {n: r["worker_p50_ms"] - r["in_process_p50_ms"] for n, r in ((1, one), (HOP_TOKENS, many))}
    result["added_ms_per_request"] = round(added[1], 3)
    result["added_ms_per_token"] = round((added[HOP_TOKENS] - added[1]) / (HOP_TOKENS - 1), 4)
    return result


def _summary(turns: list[dict], requests: int) -> dict:
    ttfts = sorted(t for turn in turns for t in turn["ttfts"])
    return {
        "tok_s": round(sum(t["tokens"] for t in turns) / sum(t["seconds"] for t in turns), 2),
        "ttft_p50_ms": round(statistics.median(ttfts) * 1000, 1),
        "ttft_p95_ms": round(ttfts[int(0.95 * (len(ttfts) - 1))] * 1000, 1),
        "adapter_loads": sum(t["adapter_loads"] for t in turns),
        "disk_loads": sum(t["disk_loads"] for t in turns),
        "merges": sum(t["merges"] for t in turns),
        "adapter_loads_per_request": round(sum(t["adapter_loads"] for t in turns) / (requests * len(turns)), 3),
        "disk_loads_per_request": round(sum(t["disk_loads"] for t in turns) / (requests * len(turns)), 3),
        "rounds_tok_s": [round(t["tokens"] / t["seconds"], 2) for t in turns],
        "rounds_requests_per_worker": [t["requests_per_worker"] for t in turns],
        "rounds_adapters_per_worker": [t["adapters_per_worker"] for t in turns],
        "rounds_steps_per_worker": [t["steps_per_worker"] for t in turns],
        "rounds_seconds": [t["seconds"] for t in turns],
    }


def _measure_hop(threads: int, count: int) -> dict:
    procs = _start_workers(1, ["--model", HOP_MODEL, "--device", "cpu", "--threads", str(threads),
                               "--kv-cache-mb", "16", "--speculative-tokens", "0"])
    local = AsyncEngine.from_config(EngineConfig(model=HOP_MODEL, device="cpu", dtype="float32", num_threads=threads,
                                                 kv_cache_bytes=16 << 20, speculative_tokens=0))
    try:
        fleet = EngineFleet([RemoteWorker(procs[0][1])])
        fleet.connect()

        async def main() -> dict:
            await fleet.start()
            try:
                return await _hop(fleet, local, count)
            finally:
                await fleet.close()
        return asyncio.run(main())
    finally:
        local.shutdown()
        for proc, _ in procs:
            proc.terminate()
            proc.wait(30)


def run_fleet_bench(model: str, workers: int, threads: int, adapters: int, rank: int, requests: int,
                    concurrency: int, new_tokens: int, max_loras: int, max_cpu_loras: int, rounds: int,
                    slack: float = 1.25, hop_requests: int = 100, popularity: str = "uniform") -> dict:
    options = ["--model", model, "--device", "cpu", "--dtype", "float32", "--threads", str(threads),
               "--max-loras", str(max_loras), "--max-cpu-loras", str(max_cpu_loras), "--max-lora-rank", str(rank),
               "--kv-cache-mb", "256", "--speculative-tokens", "0"]
    if popularity == "uniform":
        choices = random.Random(0).choices(range(adapters), k=requests)
    elif popularity.startswith("zipf:"):
        choices = zipf_choices(requests, adapters, float(popularity[5:]))
    else:
        raise ValueError(f"--popularity is uniform or zipf:<s>, got {popularity!r}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_adapters(load_model(resolve_model(model)), root, adapters, rank)
        paths = [adapter_path(root, k) for k in range(adapters)]
        procs = _start_workers(workers, options)
        try:
            fleet = EngineFleet([RemoteWorker(url) for _, url in procs], slack=slack)
            fleet.connect()
            turns: dict[str, list[dict]] = {p: [] for p in POLICIES}

            async def main() -> None:
                await fleet.start()
                try:
                    await _turn(fleet, "affinity", "warmup", paths[:2], [0, 1] * 4, model, 8, concurrency)
                    for r in range(rounds):
                        order = POLICIES if r % 2 == 0 else tuple(reversed(POLICIES))
                        for policy in order:
                            turns[policy].append(await _turn(fleet, policy, f"{policy}-{r}", paths, choices, model,
                                                             new_tokens, concurrency))
                finally:
                    await fleet.close()
            asyncio.run(main())
            hop = _measure_hop(threads, hop_requests) if hop_requests else None
        finally:
            for proc, _ in procs:
                proc.terminate()
                proc.wait(30)
    results = {"model": model, "workers": workers, "threads_per_worker": threads, "adapters": adapters,
               "popularity": popularity, "adapters_used": len(set(choices)), "rank": rank,
               "requests": requests, "concurrency": concurrency, "new_tokens": new_tokens, "max_loras": max_loras,
               "max_cpu_loras": max_cpu_loras, "rounds": rounds, "slack": slack,
               "policies": {p: _summary(turns[p], requests) for p in POLICIES}}
    if hop is not None:
        results["hop"] = hop
    a, b = results["policies"]["affinity"], results["policies"]["least_loaded"]
    results["ratios"] = {"tok_s_affinity_vs_least_loaded": round(a["tok_s"] / b["tok_s"], 3),
                         "ttft_p50_least_loaded_vs_affinity": round(b["ttft_p50_ms"] / a["ttft_p50_ms"], 3)}
    return results
