"""The soak's clients: well-behaved streaming chats (adapters, priority classes, some hanging up
mid-stream) whose every failure counts, and hostile senders (soak_hostile.py) whose answers are
only recorded. Each stops at its phase's deadline or when the phase's request cap is reached."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import httpx

from loraplex.cli.bench.soak_hostile import Hostile, bad_key, body_for

PROMPTS = ["Say something short about the sea.", "Name three colours.", "What is two plus two?",
           "Write one line of a poem about autumn.", "Describe a cat in five words."]
PRIORITIES = [None, "realtime", "standard", "batch"]
REQUEST_TIMEOUT_S = 60.0


@dataclass
class Phase:
    """One phase's deadline, request cap and everything its clients saw."""

    name: str
    deadline: float
    cap: int
    sent: int = 0
    ttft_s: list[float] = field(default_factory=list)
    completed: int = 0  # well-behaved streams read to [DONE]
    disconnected: int = 0  # well-behaved streams the client hung up on mid-stream (on purpose)
    errors: list[str] = field(default_factory=list)
    answered: dict[str, int] = field(default_factory=dict)  # request id -> HTTP status (well-behaved or hostile)
    by_priority: Counter = field(default_factory=Counter)
    by_model: Counter = field(default_factory=Counter)
    hostile: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    hostile_seconds: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    hostile_samples: dict[str, dict[str, str]] = field(default_factory=lambda: defaultdict(dict))

    def take(self) -> bool:
        """Whether one more request may start."""
        if time.monotonic() >= self.deadline or self.sent >= self.cap:
            return False
        self.sent += 1
        return True


@dataclass(frozen=True)
class Client:
    """A well-behaved client: its key, the priority class it may ask for, and the models it uses."""

    key: str
    models: tuple[str, ...]
    disconnect_share: float
    seed: int


async def well_behaved(http: httpx.AsyncClient, client: Client, phase: Phase) -> None:
    """Streams chats until the phase ends; every failure is an error."""
    rng = random.Random(client.seed)
    while phase.take():
        model, priority = rng.choice(client.models), rng.choice(PRIORITIES)
        hang_up = rng.random() < client.disconnect_share
        body = {"model": model, "stream": True, "max_tokens": rng.randint(8, 24), "temperature": 0.7,
                "messages": [{"role": "user", "content": rng.choice(PROMPTS)}], "seed": rng.randint(0, 1 << 30)}
        headers = {"authorization": f"Bearer {client.key}", **({"x-priority": priority} if priority else {})}
        phase.by_priority[priority or "key's class"] += 1
        phase.by_model[model] += 1
        try:
            await asyncio.wait_for(_stream(http, body, headers, hang_up, phase), REQUEST_TIMEOUT_S)
        except (httpx.HTTPError, TimeoutError) as exc:
            phase.errors.append(f"{model}: {type(exc).__name__} {exc}"[:300])


async def _stream(http: httpx.AsyncClient, body: dict, headers: dict, hang_up: bool, phase: Phase) -> None:
    """One streamed chat: TTFT at its first token, read to [DONE] or hung up on after it."""
    sent = time.perf_counter()
    async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
        phase.answered[response.headers.get("x-request-id", "")] = response.status_code
        if response.status_code != 200:
            phase.errors.append(f"{body['model']}: {response.status_code} {(await response.aread())[:300]!r}")
            return
        chunks, done = 0, False
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            chunks += 1
            if line == "data: [DONE]":
                done = True
                break
            if chunks == 2:  # the first after the role chunk: the first token
                phase.ttft_s.append(time.perf_counter() - sent)
                if hang_up:
                    phase.disconnected += 1
                    return  # leaving the block closes the connection mid-stream
            if '"error"' in line and json.loads(line[6:]).get("error"):
                phase.errors.append(f"{body['model']}: error event {line[6:300]}")
                return
        if done:
            phase.completed += 1
        else:
            phase.errors.append(f"{body['model']}: stream ended without [DONE]")


async def hostile(http: httpx.AsyncClient, h: Hostile, model: str, key: str, phase: Phase, max_sends: int,
                  interval_s: float) -> None:
    """Sends `h` again and again (at most `max_sends` times, `interval_s` apart) until the phase ends;
    records statuses and the first body of each."""
    for i in range(max_sends):
        if i and time.monotonic() + interval_s < phase.deadline:
            await asyncio.sleep(interval_s)
        if not phase.take():
            return
        body = body_for(h, model)
        headers = {"authorization": f"Bearer {bad_key() if h.bad_key else key}", "content-type": "application/json"}
        sent = time.perf_counter()
        try:
            response = await http.request(h.method, h.path, content=body, headers=headers,
                                          timeout=REQUEST_TIMEOUT_S)
            outcome = str(response.status_code)
            phase.answered[response.headers.get("x-request-id", "")] = response.status_code
            phase.hostile_samples[h.kind].setdefault(outcome, response.text[:300])
        except httpx.HTTPError as exc:
            outcome = type(exc).__name__
            phase.hostile_samples[h.kind].setdefault(outcome, repr(exc)[:300])
        phase.hostile[h.kind][outcome] += 1
        phase.hostile_seconds[h.kind].append(time.perf_counter() - sent)
