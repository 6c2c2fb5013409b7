"""The real server's log: one format for loraplex, uvicorn, Litestar and Alembic records, text by default
or JSON lines with LORAPLEX_LOG_FORMAT=json, and each migration said once at start."""

from __future__ import annotations

import io
import json
import logging
import re

import pytest

from loraplex.cli.logs import configure_logging
from tests.e2e.server import start
from tests.e2e.test_cli_platform import EMBEDDED

TEXT_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+: ")
FOREIGN = re.compile(r"^(INFO|WARNING|ERROR|DEBUG):\s|^(INFO|WARNING|ERROR|DEBUG) - \d{4}-")  # uvicorn's, Litestar's


def _startup_log(tmp_path, fmt: str) -> list[str]:
    server = start({**EMBEDDED, "LORAPLEX_DATA_DIR": str(tmp_path), "LORAPLEX_LOG_FORMAT": fmt}, "--access-log")
    server.stop()
    return [line for line in server.stdout if line and not line.startswith("demo api key: ")]


def _once(messages: list[str], start: str) -> None:
    assert sum(m.startswith(start) for m in messages) == 1, (start, messages)


def test_text_log_is_one_format_and_says_each_migration_once(tmp_path):
    lines = _startup_log(tmp_path, "text")
    assert not [line for line in lines if FOREIGN.match(line)], lines
    records = [line for line in lines if TEXT_LINE.match(line)]
    messages = [TEXT_LINE.sub("", line) for line in records]
    loggers = {line.split()[3].rstrip(":") for line in records}
    assert {"alembic.runtime.migration", "loraplex.serve", "uvicorn.error"} <= loggers, loggers
    _once(messages, "Running upgrade  -> 0001")
    _once(messages, "compute: C kernels on cpu")  # the compute path, in one line
    _once(messages, "serving synthetic:tiny on http://127.0.0.1:")
    _once(messages, "Application startup complete.")
    assert not any(m.startswith(("Context impl", "Will assume")) for m in messages)
    assert lines == records, [line for line in lines if not TEXT_LINE.match(line)]  # one line a record


def test_json_log_is_one_object_a_line(tmp_path):
    lines = _startup_log(tmp_path, "json")
    records = [json.loads(line) for line in lines]  # every line is JSON
    assert all({"ts", "level", "logger", "message"} <= r.keys() for r in records)
    assert all(re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00$", r["ts"]) for r in records)
    messages = [r["message"] for r in records]
    _once(messages, "Running upgrade  -> 0001")
    _once(messages, "compute: C kernels on cpu")
    _once(messages, "Uvicorn running on")
    assert {"alembic.runtime.migration", "loraplex.serve", "uvicorn.error"} <= {r["logger"] for r in records}
    assert not any("color_message" in r for r in records)


def test_json_records_carry_extra_fields_and_tracebacks():
    out = io.StringIO()
    configure_logging("info", "json", out)
    try:
        logging.getLogger("loraplex.test").warning("budget %s near", "acme", extra={"tenant": "acme", "used": 9})
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            logging.getLogger("loraplex.test").exception("failed")
    finally:
        configure_logging("warning", "text")
    first, second = (json.loads(line) for line in out.getvalue().splitlines())
    assert (first["level"], first["logger"], first["message"]) == ("WARNING", "loraplex.test", "budget acme near")
    assert (first["tenant"], first["used"]) == ("acme", 9)
    assert second["message"] == "failed" and "RuntimeError: boom" in second["exc"]


def test_a_bad_log_format_is_one_line(monkeypatch, capsys):
    from loraplex.cli.main import main

    monkeypatch.setenv("LORAPLEX_LOG_FORMAT", "xml")
    assert main(["serve", "--device", "cpu"]) == 2
    assert capsys.readouterr().err.strip() == "loraplex: error: LORAPLEX_LOG_FORMAT must be text or json, got 'xml'"


@pytest.fixture(autouse=True)
def _restore_root_logger():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
