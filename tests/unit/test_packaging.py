"""Packaging: the engine runs on a box that has torch and the engine's few packages but none of the
platform's (a GPU image bringing its own torch), and the package does not pin torch."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PLATFORM_PACKAGES = ["litestar", "sqlalchemy", "alembic", "redis", "asyncpg", "aiosqlite", "msgspec", "uvicorn",
                     "httpx", "prometheus_client", "uvloop", "httptools"]

# Any import of a platform package fails, as on a box where it is not installed.
_ENGINE_ONLY = f"""
import importlib.abc, pkgutil, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {PLATFORM_PACKAGES!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked)")
sys.meta_path.insert(0, Block())
import loraplex.engine
for m in pkgutil.walk_packages(loraplex.engine.__path__, "loraplex.engine."):
    importlib.import_module(m.name)
from loraplex.engine.api import GenerateRequest, SamplingParams
from loraplex.engine.config import EngineConfig
from loraplex.engine.core import EngineCore
core = EngineCore(EngineConfig(model="synthetic:tiny", device="cpu", num_kv_blocks=16))
sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
done = core.run([GenerateRequest("r", "synthetic:tiny", prompt_token_ids=(1, 2, 3), sampling=sp)])
assert len(done[0].token_ids) == 4
print("engine-only ok", sorted(set(m.split(".")[0] for m in sys.modules) & set({PLATFORM_PACKAGES!r})))
"""


def test_the_engine_imports_and_runs_without_the_platforms_packages():
    out = subprocess.run([sys.executable, "-c", _ENGINE_ONLY], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "engine-only ok []" in out.stdout


def test_the_package_asks_a_torch_range_and_the_makefile_pins_the_cpu_build():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_req = [d for d in deps if d.startswith("torch")]
    assert torch_req == ["torch>=2.5"]
    assert "torch==" in (ROOT / "constraints-cpu.txt").read_text()
    assert "-c constraints-cpu.txt" in (ROOT / "Makefile").read_text()
