"""Shared test setup: the device the engine tests run on, engines on synthetic tiny models, the real
default model loaded once.

The device: `pytest --device cuda` (or cuda:N, or env LORAPLEX_TEST_DEVICE; default cpu). Engine, LoRA,
attention and kernel tests build their engines and tensors there (`device` fixture, `test_device()`,
`make_core`); platform tests (tests/integration, tests/e2e) keep their engines on the CPU; tests marked
`cpu_kernels` (the C kernels, tests/kernels/test_cpu_*.py) are skipped off the CPU.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import sys
import tempfile
from pathlib import Path

import pytest
import torch

# pytest imports this file as `conftest`, test modules as `tests.conftest`: make them one module, so that
# the hooks below and the helpers tests import share the device state and the weight cache.
if __name__ != "tests.conftest":
    sys.modules.setdefault("tests.conftest", sys.modules[__name__])

os.environ.setdefault("LORAPLEX_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".cache", "test"))
torch.set_num_threads(min(2, torch.get_num_threads()))

DEVICE_ENV = "LORAPLEX_TEST_DEVICE"
CPU_KERNELS = "cpu_kernels"
TESTS = Path(__file__).parent
PLATFORM_DIRS = (TESTS / "integration", TESTS / "e2e")  # their engines stay on the CPU whatever --device says
CPU = torch.device("cpu")
_in_platform_test = False  # set while a test under PLATFORM_DIRS runs (pytest_runtest_protocol)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--device", default=os.environ.get(DEVICE_ENV) or "cpu",
                     help=f"device of the engine, LoRA, attention and kernel tests: cpu, cuda or cuda:N "
                          f"(default: ${DEVICE_ENV} or cpu)")


def parse_device(name: str) -> torch.device:
    """The test device named by --device / LORAPLEX_TEST_DEVICE; pytest.UsageError (one line) unless it
    is cpu, or a CUDA device this machine has."""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", name):
        raise pytest.UsageError(f"--device (or {DEVICE_ENV}) must be cpu, cuda or cuda:N, got {name!r}")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise pytest.UsageError(f"--device (or {DEVICE_ENV}) is {name!r} but CUDA is not available here "
                                    "(torch.cuda.is_available() is False)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise pytest.UsageError(f"--device (or {DEVICE_ENV}) is {name!r} but this machine has "
                                    f"{torch.cuda.device_count()} CUDA device(s)")
    return device


def pytest_configure(config: pytest.Config) -> None:
    """Validates the device, publishes it in the environment (test_device() reads it) and sets Triton's mode
    before collection imports any kernel module."""
    device = parse_device(config.getoption("--device"))
    os.environ[DEVICE_ENV] = str(device)
    if device.type != "cpu":  # (make test exports it): the CUDA run tests the compiled Triton kernels
        os.environ.pop("TRITON_INTERPRET", None)
    else:  # read when a kernel module is imported (collection, later): the CPU runs Triton in its interpreter
        os.environ["TRITON_INTERPRET"] = "1"
    config.addinivalue_line("markers", f"{CPU_KERNELS}: calls the C kernels (loraplex.engine.kernels.cpu) directly; "
                                       "skipped when the test device is not the CPU")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Off the CPU, skips the C-kernel tests: tests/kernels/test_cpu_*.py and tests marked cpu_kernels."""
    device = session_device()
    if device.type == "cpu":
        return
    skip = pytest.mark.skip(reason=f"tests the CPU's C kernels; the test device is {device}")
    for item in items:
        path = Path(item.path)
        c_kernel_file = path.parent == TESTS / "kernels" and path.name.startswith("test_cpu_")
        if c_kernel_file or item.get_closest_marker(CPU_KERNELS):
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Marks the span of a platform test (setup, including session fixtures it starts, call, teardown)."""
    global _in_platform_test
    _in_platform_test = any(Path(item.path).is_relative_to(d) for d in PLATFORM_DIRS)
    try:
        yield
    finally:
        _in_platform_test = False


def session_device() -> torch.device:
    """The device chosen for this session (--device), whatever test runs."""
    return torch.device(os.environ.get(DEVICE_ENV) or "cpu")


def test_device() -> torch.device:
    """The device the running test builds engines and tensors on: the session's (--device), or the CPU
    during a platform test. For code that is not a fixture (helpers, module-level tables)."""
    return CPU if _in_platform_test else session_device()


test_device.__test__ = False  # imported into test modules: not a test itself


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The device engine, LoRA, attention and kernel tests run on (--device)."""
    return session_device()


def on_cpu() -> bool:
    """True when the running test's device is the CPU (for assertions about CPU-only paths: the C kernels'
    folds and merged copies)."""
    return test_device().type == "cpu"


def make_core(model: str = "synthetic:tiny", **overrides):
    """An fp32 EngineCore on the test device (or `device=`) over weights loaded once per session."""
    from loraplex.engine.config import EngineConfig
    from loraplex.engine.core import EngineCore

    params = {"device": str(test_device()), "dtype": "float32", "num_kv_blocks": 256, "block_size": 16}
    params.update(overrides)
    config = EngineConfig(model=model, **params)
    return EngineCore(config, loaded=_loaded(model, config.torch_device))


_LOADED: dict = {}


def _loaded(model: str, device: torch.device | str | None = None):
    """Loads each model once per test session and device (default: the test device) in fp32 (weights are
    read-only to the engine)."""
    from loraplex.engine.models.loader import load_model, resolve_model

    device = torch.device(device) if device is not None else test_device()
    if (model, device) not in _LOADED:
        _LOADED[model, device] = load_model(resolve_model(model), torch.float32, device)
    return _LOADED[model, device]


@pytest.fixture
def tiny_core():
    return make_core()


@pytest.fixture(scope="session")
def default_model():
    """The real default model on the CPU: the side the HF transformers references read."""
    return _loaded("smollm2-135m", CPU)


@contextlib.contextmanager
def one_ray_cluster():
    """Holds this machine's one local Ray cluster for the block: tests join "the newest cluster" (address="auto")
    and two clusters starve a small machine, so with pytest-xdist a test that starts one waits for the other's end
    (an exclusive lock on a file, held across processes)."""
    with open(Path(tempfile.gettempdir()) / "loraplex-tests-ray.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (released when the file closes)
        yield
