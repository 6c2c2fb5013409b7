"""What an operator meets first: `loraplex doctor` (with and without a C compiler), a command run where
there is no database, and an internal error (one line, or a traceback with LORAPLEX_DEBUG=1)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

from loraplex.cli import tenants
from loraplex.cli.main import main
from loraplex.platform.db.provision import create_database, drop_database
from tests.e2e.server import PG_SERVER
from tests.e2e.test_cli_platform import EMBEDDED

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def loraplex(cwd, env: dict, *args: str) -> subprocess.CompletedProcess:
    """The command as a user runs it, from `cwd`, with no LORAPLEX_DATA_DIR unless `env` sets one."""
    base = {k: v for k, v in os.environ.items() if k not in ("LORAPLEX_DATA_DIR", "CC")}
    base["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "loraplex.cli.main", *args], cwd=cwd, capture_output=True,
                          text=True, env={**base, **EMBEDDED, **env}, timeout=300)


def doctor(cwd, env: dict) -> tuple[int, dict]:
    done = loraplex(cwd, env, "doctor", "--json")
    return done.returncode, {row["check"]: row for row in json.loads(done.stdout)}


def test_a_command_where_no_database_exists_says_so_and_creates_nothing(tmp_path):
    for args in (("tenants", "list"), ("keys", "list", "--tenant", "x"), ("db", "current")):
        out = loraplex(tmp_path, {}, *args)
        (line,) = out.stderr.strip().splitlines()
        assert out.returncode == 2 and line.startswith("loraplex: error: no database found at "), out.stderr
        assert str(tmp_path / ".loraplex" / "loraplex.db") in line
        assert "LORAPLEX_DATABASE_URL" in line and "make serve" in line and "loraplex db upgrade" in line
        assert list(tmp_path.iterdir()) == []  # no ./.loraplex/ left behind
    assert loraplex(tmp_path, {}, "db", "upgrade").returncode == 0  # `db upgrade` (and `serve`) create it
    listed = loraplex(tmp_path, {}, "tenants", "list")
    assert listed.returncode == 0 and listed.stdout.split() == ["NAME", "TIER", "STATUS", "DEFAULT", "MAX", "TOKENS",
                                                                "CREATED", "AT"]
    assert json.loads(loraplex(tmp_path, {}, "tenants", "list", "--json").stdout) == []


def test_a_postgres_database_that_is_missing_or_empty_says_how_to_point_at_one(tmp_path):
    url = asyncio.run(create_database(PG_SERVER, prefix="loraplex_test_ops_"))
    try:
        empty = loraplex(tmp_path, {"LORAPLEX_DATABASE_URL": url}, "tenants", "list")
        assert empty.returncode == 2 and "has no loraplex tables" in empty.stderr and "db upgrade" in empty.stderr
        code, checks = doctor(tmp_path, {"LORAPLEX_DATABASE_URL": url})
        assert code == 0 and checks["database"]["status"] == "warn", checks["database"]
        assert loraplex(tmp_path, {"LORAPLEX_DATABASE_URL": url}, "db", "upgrade").returncode == 0
        code, checks = doctor(tmp_path, {"LORAPLEX_DATABASE_URL": url, "LORAPLEX_REDIS_URL": "redis://localhost:6379/0"})
        assert code == 0 and checks["database"]["status"] == "ok" and "the newest" in checks["database"]["detail"]
        assert checks["redis"]["status"] == "ok" and "answers" in checks["redis"]["detail"]
    finally:
        asyncio.run(drop_database(url))
    gone = loraplex(tmp_path, {"LORAPLEX_DATABASE_URL": url}, "tenants", "list")
    (line,) = gone.stderr.strip().splitlines()
    assert gone.returncode == 2 and "does not exist" in line and "LORAPLEX_DATABASE_URL" in line
    code, checks = doctor(tmp_path, {"LORAPLEX_DATABASE_URL": url})
    assert code == 1 and checks["database"]["status"] == "fail"


def test_doctor_with_this_machines_compiler(tmp_path):
    code, checks = doctor(tmp_path, {})
    assert code == 0, checks
    assert checks["compute"]["status"] == "ok" and checks["compute"]["detail"].startswith("C kernels on cpu: built")
    assert "AVX2" in checks["instruction sets"]["detail"] and "kernels' build" in checks["instruction sets"]["detail"]
    assert int(checks["threads"]["detail"]) >= 1
    kv = checks["kv cache dtype"]["detail"]
    assert checks["model dtype"]["detail"].startswith("float32") and kv.startswith("float32")
    assert kv.endswith("int8 caches smooth K per channel: on (--kv-cache-dtype, --kv-cache-smoothing)")
    dot = checks["activation dtype"]["detail"]  # this build's int8 dot: the kernels' build names its ISA
    assert dot.startswith("float32; int8 over GGUF blocks: ") and dot.endswith("(--activation-dtype)")
    assert ("VNNI" in dot) == ("AVX-512 VNNI" in checks["instruction sets"]["detail"])
    assert checks["database"]["status"] == "warn" and "no database yet" in checks["database"]["detail"]
    assert checks["redis"]["status"] == "ok" and checks["redis"]["detail"].startswith("not used")
    assert list(tmp_path.iterdir()) == []  # looking is not creating
    table = loraplex(tmp_path, {}, "doctor")
    assert table.returncode == 0 and table.stdout.splitlines()[0].split() == ["CHECK", "STATUS", "DETAIL"]


def test_doctor_without_a_compiler_says_torch_fallback_and_why(tmp_path):
    env = {"CC": "false", "LORAPLEX_REDIS_URL": "redis://127.0.0.1:9/0"}  # and a Redis that does not answer
    done = loraplex(tmp_path, env, "doctor", "--json")
    checks = {row["check"]: row for row in json.loads(done.stdout)}
    assert checks["compute"]["status"] == "warn"
    assert checks["compute"]["detail"] == "torch ops (fallback, slower) on cpu: no C compiler ('false' is not on " \
                                          "PATH or does not run)"
    assert "the CPU's" in checks["instruction sets"]["detail"]
    assert checks["activation dtype"]["detail"] == "float32; int8 over GGUF blocks: not here (needs the C kernels) " \
                                                   "(--activation-dtype)"
    assert checks["redis"]["status"] == "fail" and "does not answer" in checks["redis"]["detail"]
    assert done.returncode == 1  # Redis is required once configured; the torch fallback is not
    warnings = [line for line in done.stderr.splitlines() if "CPU kernels not built" in line]
    assert len(warnings) == 1 and "falling back to torch ops" in warnings[0]


def _boom(args):
    raise KeyError("a bug, not the user's doing")


@pytest.mark.parametrize("debug", ["", "1"])
def test_an_internal_error_is_one_line_unless_debugging(monkeypatch, capsys, debug):
    monkeypatch.setattr(tenants, "_list", _boom)  # (the parser is built after this: `tenants list` runs it)
    monkeypatch.setenv("LORAPLEX_DEBUG", debug)
    assert main(["tenants", "list"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("loraplex: internal error: KeyError: \"a bug, not the user's doing\" "
                       "(set LORAPLEX_DEBUG=1 for the traceback)")
    if debug:
        assert err[0] == "Traceback (most recent call last):" and any("_boom" in line for line in err)
    else:
        assert len(err) == 1


def test_a_user_error_stays_one_line_and_debug_adds_its_traceback(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("LORAPLEX_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("LORAPLEX_DEBUG", "")
    assert main(["tenants", "create", "x", "--default-max-tokens", "-3"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "loraplex: error: --default-max-tokens must be a positive integer, got '-3'"]
    monkeypatch.setenv("LORAPLEX_DEBUG", "1")
    assert main(["tenants", "create", "x", "--default-max-tokens", "-3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("Traceback") and err[-1].startswith("loraplex: error: --default-max-tokens")
