"""Starts the real `loraplex serve` process for e2e tests and waits until it is ready."""

from __future__ import annotations

import os
import queue
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    base_url: str
    stdout: list[str] = field(default_factory=list)

    @property
    def demo_keys(self) -> list[str]:
        return [line.split(": ", 1)[1] for line in self.stdout if line.startswith("demo api key: ")]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start(env: dict, *args: str, timeout_s: float = 120) -> Server:
    """`python -m loraplex.cli.main serve --model synthetic:tiny --port <free>` with `env` added;
    returns once /ready answers 200 (or fails with the process's output)."""
    port = free_port()
    cmd = [sys.executable, "-m", "loraplex.cli.main", "serve", "--model", "synthetic:tiny", "--device", "cpu",
           "--port", str(port), "--kv-cache-mb", "16", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **env})
    server = Server(proc, f"http://127.0.0.1:{port}")
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line.rstrip("\n")) for line in proc.stdout], daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        while not lines.empty():
            server.stdout.append(lines.get())
        if proc.poll() is not None:
            raise RuntimeError("server exited:\n" + "\n".join(server.stdout))
        try:
            if httpx.get(f"{server.base_url}/ready", timeout=2).status_code == 200:
                time.sleep(0.1)
                while not lines.empty():
                    server.stdout.append(lines.get())
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    server.stop()
    raise RuntimeError("server not ready in time:\n" + "\n".join(server.stdout))
