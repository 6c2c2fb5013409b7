"""The test device option (tests/conftest.py): `pytest --device` / LORAPLEX_TEST_DEVICE picks where engine,
LoRA, attention and kernel tests run; a device that is not cpu, cuda or cuda:N, or CUDA where there is none,
stops pytest at configure time with one line (exit code 4, a usage error)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import DEVICE_ENV, parse_device, test_device

ROOT = Path(__file__).resolve().parents[2]
USAGE_ERROR = 4  # pytest.ExitCode.USAGE_ERROR


def test_the_device_fixture_and_test_device_name_the_chosen_device(device):
    """(Also the tiny test the subprocesses below run.)"""
    assert device == test_device() == torch.device(os.environ[DEVICE_ENV])
    assert torch.zeros(1, device=device).device.type == device.type


def pytest_in_subprocess(*args: str, **env: str) -> subprocess.CompletedProcess:
    """Runs pytest on the test above in a fresh interpreter from the repository root, with `env` over an
    environment where the device variable is unset. Plugins are not auto-loaded (schemathesis and playwright
    take seconds to import); pytest-timeout is, for the ini's `timeout`."""
    base = {k: v for k, v in os.environ.items() if k != DEVICE_ENV} | {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    test = f"{Path(__file__).relative_to(ROOT)}::test_the_device_fixture_and_test_device_name_the_chosen_device"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "pytest_timeout", *args, test]
    return subprocess.run(cmd, cwd=ROOT, env=base | env, capture_output=True, text=True, timeout=300)


def assert_refused(run: subprocess.CompletedProcess, says: str) -> None:
    """Exit code 4 and one line naming the problem, no traceback."""
    output = run.stdout + run.stderr
    assert run.returncode == USAGE_ERROR, output
    lines = [line for line in output.splitlines() if says in line]
    assert len(lines) == 1 and lines[0].startswith("ERROR: "), output
    assert "Traceback" not in output and "passed" not in output, output


def test_an_unknown_device_is_a_usage_error_in_one_line():
    assert_refused(pytest_in_subprocess("--device", "tpu"),
                   f"--device (or {DEVICE_ENV}) must be cpu, cuda or cuda:N, got 'tpu'")


def test_cuda_from_the_environment_without_cuda_is_refused_the_same_way():
    """(CUDA hidden from the subprocess, so that this holds on a GPU machine too.)"""
    assert_refused(pytest_in_subprocess(CUDA_VISIBLE_DEVICES="", **{DEVICE_ENV: "cuda"}),
                   f"--device (or {DEVICE_ENV}) is 'cuda' but CUDA is not available here")


def test_the_session_device_is_the_parsed_option(pytestconfig):
    """This session's own device came through the option (whose default is the environment, else cpu)."""
    assert test_device() == parse_device(pytestconfig.getoption("--device"))


@pytest.mark.parametrize("name", ["tpu", "gpu", "cuda:", "cuda:x", "CPU", " cpu", "cpu:0", "cuda:0:1"])
def test_parse_device_accepts_only_cpu_cuda_and_cuda_n(name):
    with pytest.raises(pytest.UsageError, match="must be cpu, cuda or cuda:N"):
        parse_device(name)


def test_parse_device_refuses_cuda_where_there_is_none(monkeypatch):
    assert parse_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("cuda", "cuda:0", "cuda:3"):
        with pytest.raises(pytest.UsageError, match=f"is '{name}' but CUDA is not available here"):
            parse_device(name)
