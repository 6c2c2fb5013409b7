"""The durable local spool: usage events that could not reach the database, one JSON line each.

Each process appends to its own file (`ledger-<instance>.jsonl`) and holds an exclusive flock on
it, and every append is flushed and fsync'd before it returns. To replay, the file is renamed
aside (`replay-<instance>-<n>.jsonl`, still locked) and written to the ledger in batches; it is
deleted only once every event in it is in the database. A crash in between replays it again,
which the ledger's `ON CONFLICT (request_id) DO NOTHING` makes harmless.

A file whose lock nobody holds belongs to a process that is gone: the next process to start on
the same data directory claims it, and its events are replayed like its own.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from loraplex.billing.usage import UsageEvent

log = logging.getLogger("loraplex.ledger")


class _Locked:
    """An open, flock'ed file in the spool directory."""

    def __init__(self, path: Path, fd: int):
        self.path, self.fd = path, fd

    @classmethod
    def open(cls, path: Path, wait: bool = True) -> _Locked | None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            return None
        return cls(path, fd)

    def rename(self, path: Path) -> None:
        os.replace(self.path, path)
        self.path = path

    def close(self, delete: bool = False) -> None:
        if delete:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        os.close(self.fd)


def _read(path: Path) -> list[UsageEvent]:
    events = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                events.append(UsageEvent.from_json(json.loads(line)))
            except (ValueError, TypeError, KeyError):  # a torn last line: that append never returned
                log.error("spool %s line %d is not a usage event; skipped", path.name, number)
    return events


class Spool:
    def __init__(self, directory: Path, instance: str):
        self.dir = Path(directory)
        self.instance = instance
        self._active: _Locked | None = None
        self._replays: list[_Locked] = []
        self._serial = 0
        self.events = 0  # events in this process's files, not yet known to be in the database
        self.bytes = 0

    def _path(self, kind: str) -> Path:
        self._serial += 1
        return self.dir / f"{kind}-{self.instance}-{self._serial}.jsonl"

    def append(self, events: list[UsageEvent]) -> None:
        """Durable when it returns: written, flushed and fsync'd."""
        if not events:
            return
        if self._active is None:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._active = _Locked.open(self.dir / f"ledger-{self.instance}.jsonl")
        data = "".join(json.dumps(e.to_json(), separators=(",", ":")) + "\n" for e in events).encode()
        view = memoryview(data)
        while view:
            view = view[os.write(self._active.fd, view):]
        os.fsync(self._active.fd)
        self.events += len(events)
        self.bytes += len(data)

    def claim_orphans(self) -> list[UsageEvent]:
        """Takes over the files of processes that are gone; returns their events (to replay)."""
        if not self.dir.is_dir():
            return []
        claimed: list[UsageEvent] = []
        for path in sorted(self.dir.glob("*.jsonl")):
            if self.instance in path.name:
                continue
            with contextlib.suppress(FileNotFoundError):
                locked = _Locked.open(path, wait=False)
                if locked is None:  # a live process holds it
                    continue
                locked.rename(self._path("replay"))
                events = _read(locked.path)
                self._replays.append(locked)
                self.events += len(events)
                self.bytes += locked.path.stat().st_size
                claimed.extend(events)
        if claimed:
            log.warning("claimed %d usage events from the spool of a stopped process", len(claimed))
        return claimed

    def pending(self) -> Iterator[tuple[_Locked, list[UsageEvent]]]:
        """Each file to replay with its events: the active file is set aside first."""
        if self._active is not None:
            self._active.rename(self._path("replay"))
            self._replays.append(self._active)
            self._active = None
        for locked in list(self._replays):
            yield locked, _read(locked.path)

    def done(self, locked: _Locked, count: int) -> None:
        """Every event of `locked` is in the database: delete it."""
        size = locked.path.stat().st_size
        self._replays.remove(locked)
        locked.close(delete=True)
        self.events = max(0, self.events - count)
        self.bytes = max(0, self.bytes - size)

    @property
    def empty(self) -> bool:
        return self._active is None and not self._replays

    def close(self) -> None:
        """Releases the locks; files with events stay for the next process on this data directory."""
        for locked in [*self._replays, *([self._active] if self._active else [])]:
            locked.close()
        self._replays, self._active = [], None
