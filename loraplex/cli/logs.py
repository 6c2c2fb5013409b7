"""One log format for the whole process (loraplex, uvicorn, Litestar, Alembic): every record goes through
the root logger's one handler on stderr.

- LORAPLEX_LOG_FORMAT=text (default): `<time> <LEVEL> <logger>: <message>`; `json`: one JSON object a
  line with ts (ISO-8601, UTC), level, logger, message, the record's extra fields, and exc (a traceback).
- uvicorn is started with `log_config=None` and Litestar with `logging_config=None` (cli/serve.py,
  platform/app.py), so neither installs handlers or formats of its own.
- Alembic's "Context impl ..." / "Will assume ... DDL" lines, said each time a migration context opens
  (at the upgrade and again when the app checks the revision), are dropped: migrations are logged once.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from datetime import UTC, datetime

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# A LogRecord's own attributes; anything else on a record came from `extra=` and is written out
# (and uvicorn's color_message, its message with terminal colour codes)
_RECORD_FIELDS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime",
                                                                                     "color_message"}
_ALEMBIC_CHATTER = ("Context impl ", "Will assume ")


class JsonFormatter(logging.Formatter):
    """A record as one line of JSON."""

    def format(self, record: logging.LogRecord) -> str:
        line = {"ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
                "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        for key, value in vars(record).items():
            if key not in _RECORD_FIELDS and not key.startswith("_"):
                line[key] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def _not_alembic_chatter(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(_ALEMBIC_CHATTER)


def log_format(env: dict | None = None) -> str:
    value = (env if env is not None else os.environ).get("LORAPLEX_LOG_FORMAT", "").strip().lower() or "text"
    if value not in LOG_FORMATS:
        raise ValueError(f"LORAPLEX_LOG_FORMAT must be text or json, got {value!r}")
    return value


def configure_logging(level: str = "info", fmt: str | None = None, stream=None) -> None:
    """Replaces the root logger's handlers with one in the chosen format; the loggers of uvicorn and
    Litestar hand their records to it."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if (fmt or log_format()) == "json" else logging.Formatter(TEXT_FORMAT))
    handler.addFilter(_not_alembic_chatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "litestar"):
        named = logging.getLogger(name)
        named.handlers.clear()
        named.propagate = True
