"""The durable local spool: usage events that could not reach the database, one JSON line each.

Each process appends to its own file (`ledger-<instance>.jsonl`) and holds an exclusive flock on
it, and every append is flushed and fsync'd before it returns. To replay, the file is renamed
aside (`replay-<instance>-<n>.jsonl`, still locked) and written to the ledger in batches; it is
deleted only once every event in it is in the database. A crash in between replays it again,
which the ledger's `ON CONFLICT (request_id) DO NOTHING` makes harmless.

A file whose lock nobody holds belongs to a process that is gone: the next process to start on
the same data directory claims it, and its events are replayed like its own.

Every method does file work (open, write, fsync, rename, read) and may block: the ledger writer
calls them on its one spool thread, in order, never on the event loop; a lock makes each one
whole. An append that fails (disk full, I/O error, the directory gone) raises and leaves the file
as it was (what it wrote is cut off again, or, where that fails too, the next append starts on a
new line so that the torn one is skipped alone); the caller keeps the events and tries again.

Events the database refuses for their content go to `quarantine.jsonl` (one JSON line each:
the event and the database's error), shared by the processes of this directory and never
replayed: an operator fixes or discards them.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import threading
from pathlib import Path

from loraplex.billing.usage import UsageEvent

log = logging.getLogger("loraplex.ledger")
QUARANTINE = "quarantine.jsonl"
_SPOOLED = ("ledger-", "replay-")  # the files claim_orphans may take over


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
        try:
            if delete:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)
        finally:
            os.close(self.fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


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
    """This process's spool files; thread-safe, blocking (see the module's docstring)."""

    def __init__(self, directory: Path, instance: str):
        self.dir = Path(directory)
        self.instance = instance
        self._active: _Locked | None = None
        self._active_events = 0
        self._torn = False  # the active file may end in a partial line
        self._replays: list[_Locked] = []
        self._serial = 0
        self._lock = threading.Lock()
        self.events = 0  # events in this process's files, not yet known to be in the database
        self.bytes = 0

    def _path(self, kind: str) -> Path:
        self._serial += 1
        return self.dir / f"{kind}-{self.instance}-{self._serial}.jsonl"

    def append(self, events: list[UsageEvent]) -> None:
        """Durable when it returns: written, flushed and fsync'd. Raises OSError with nothing added."""
        if not events:
            return
        data = "".join(json.dumps(e.to_json(), separators=(",", ":")) + "\n" for e in events).encode()
        with self._lock:
            if self._active is None:
                self.dir.mkdir(parents=True, exist_ok=True)
                self._active = _Locked.open(self.dir / f"ledger-{self.instance}.jsonl")
                self._active_events, self._torn = 0, False
            fd = self._active.fd
            size = os.fstat(fd).st_size
            try:
                _write_all(fd, (b"\n" if self._torn else b"") + data)
                os.fsync(fd)
            except OSError:
                self._undo(size)
                raise
            self._torn = False
            self._active_events += len(events)
            self.events += len(events)
            self.bytes += len(data)

    def _undo(self, size: int) -> None:
        """After a failed append: cut the file back; a file holding nothing of ours is dropped, so
        that the next append opens its path afresh."""
        try:
            os.ftruncate(self._active.fd, size)
        except OSError:
            self._torn = True
        if self._active_events == 0:
            with contextlib.suppress(OSError):
                self._active.close(delete=True)
            self._active = None

    def quarantine(self, refused: list[tuple[UsageEvent, str]]) -> None:
        """Keeps events the database refused, with its error, in the quarantine file (fsync'd)."""
        if not refused:
            return
        data = "".join(json.dumps({"error": error, "event": e.to_json()}, separators=(",", ":")) + "\n"
                       for e, error in refused).encode()
        with self._lock:
            self.dir.mkdir(parents=True, exist_ok=True)
            locked = _Locked.open(self.dir / QUARANTINE)
            try:
                size = os.fstat(locked.fd).st_size
                if size and os.pread(locked.fd, 1, size - 1) != b"\n":
                    data = b"\n" + data  # a torn line from an earlier failure stays alone
                _write_all(locked.fd, data)
                os.fsync(locked.fd)
            finally:
                locked.close()

    def claim_orphans(self) -> list[UsageEvent]:
        """Takes over the files of processes that are gone; returns their events (to replay)."""
        if not self.dir.is_dir():
            return []
        claimed: list[UsageEvent] = []
        with self._lock:
            for path in sorted(self.dir.glob("*.jsonl")):
                if self.instance in path.name or not path.name.startswith(_SPOOLED):
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

    def set_aside(self) -> list[_Locked]:
        """The files to replay, oldest first; the active file is renamed aside first, so appends
        made meanwhile go to a new one."""
        with self._lock:
            if self._active is not None:
                self._active.rename(self._path("replay"))
                self._replays.append(self._active)
                self._active = None
            return list(self._replays)

    def read(self, locked: _Locked) -> list[UsageEvent]:
        with self._lock:
            return _read(locked.path)

    def done(self, locked: _Locked, count: int) -> None:
        """Every event of `locked` is in the database (or quarantined): delete it."""
        with self._lock:
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
        with self._lock:
            for locked in [*self._replays, *([self._active] if self._active else [])]:
                locked.close()
            self._replays, self._active = [], None
