"""The spool when the disk fails under it: an append that cannot be written raises with nothing
added (the writer keeps the events), and the file stays readable for the appends that follow."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import textwrap
import threading
from datetime import UTC, datetime
from pathlib import Path

import pytest

from loraplex.billing.ledger import LedgerWriter
from loraplex.billing.spool import QUARANTINE, Spool, _read
from loraplex.billing.tail import Tail
from loraplex.billing.usage import UsageEvent
from loraplex.platform.db.database import make_engine


def _event(request_id: str) -> UsageEvent:
    return UsageEvent(request_id=request_id, tenant_id=1, tenant="t", key_id=1, key_prefix="lpx-x", model="m",
                      adapter=None, priority="standard", prompt_tokens=3, cached_tokens=0, completion_tokens=2,
                      ttft_s=None, latency_s=0.1, status="ok", finish_reason="stop", created_at=datetime.now(UTC))


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_an_append_to_a_full_device_raises_and_the_next_one_starts_clean(tmp_path):
    spool = Spool(tmp_path, "w")
    (tmp_path / "ledger-w.jsonl").symlink_to("/dev/full")  # every write: ENOSPC
    with pytest.raises(OSError):
        spool.append([_event("a"), _event("b")])
    assert spool.events == 0 and spool.empty
    spool.append([_event("c")])  # the failed file was let go: this one is a real file
    assert [e.request_id for e in _read(tmp_path / "ledger-w.jsonl")] == ["c"] and spool.events == 1
    spool.close()


_FILE_SIZE_LIMIT = """
import resource, signal, sys
from datetime import UTC, datetime
from pathlib import Path
from loraplex.billing.spool import Spool, _read
from loraplex.billing.usage import UsageEvent

def event(i):
    return UsageEvent(request_id=f"r{i}", tenant_id=1, tenant="t", key_id=1, key_prefix="lpx-x", model="m",
                      adapter=None, priority="standard", prompt_tokens=3, cached_tokens=0, completion_tokens=2,
                      ttft_s=None, latency_s=0.1, status="ok", finish_reason="stop", created_at=datetime.now(UTC))

directory = Path(sys.argv[1])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
spool = Spool(directory, "w")
spool.append([event(0)])
size = (directory / "ledger-w.jsonl").stat().st_size
resource.setrlimit(resource.RLIMIT_FSIZE, (size * 3, hard))  # a disk with room for about two more events
try:
    spool.append([event(i) for i in range(1, 20)])
except OSError as exc:
    print("failed", exc.errno)
assert (directory / "ledger-w.jsonl").stat().st_size == size, "the partial write was not cut off"
assert spool.events == 1
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))  # room again
spool.append([event(i) for i in range(1, 20)])
print("events", ",".join(e.request_id for e in _read(directory / "ledger-w.jsonl")))
"""


def test_a_write_cut_short_by_the_disk_leaves_no_partial_line(tmp_path):
    """A real short write: the process may not grow the file past a limit (RLIMIT_FSIZE, in a
    child process so that nothing else here is limited)."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(_FILE_SIZE_LIMIT), str(tmp_path)], capture_output=True,
                         text=True, timeout=60, cwd=Path(__file__).parents[2])
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("failed")
    assert lines[1] == "events " + ",".join(f"r{i}" for i in range(20))


def test_quarantined_events_are_kept_with_their_error_and_never_replayed(tmp_path):
    spool = Spool(tmp_path, "w")
    spool.quarantine([(_event("bad"), "DataError: value too long")])
    spool.close()
    again = Spool(tmp_path, "next")
    assert again.claim_orphans() == [] and again.empty  # the quarantine is not a spool to replay
    assert "value too long" in (tmp_path / QUARANTINE).read_text()
    again.close()


class _Watched(Spool):
    """A real spool that notes which thread does its file work."""

    def __init__(self, *args):
        super().__init__(*args)
        self.threads: set[str] = set()

    def append(self, events):
        self.threads.add(threading.current_thread().name)
        super().append(events)


def _unreachable_writer(spool: Spool, **kwargs) -> LedgerWriter:
    """A writer whose database refuses connections (nothing listens on the port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return LedgerWriter(make_engine(f"postgresql://nobody@127.0.0.1:{port}/none"), spool, Tail(), batch_size=10,
                        flush_interval_s=3600, **kwargs)


def test_spool_writes_run_on_the_spool_thread_not_the_event_loop(tmp_path):
    spool = _Watched(tmp_path, "w")
    writer = _unreachable_writer(spool)

    async def main():
        writer.start()
        for i in range(5):
            writer.emit(_event(f"r{i}"))
        await writer.flush()
        await writer.close()

    asyncio.run(main())
    assert writer.down and writer.events_spooled == 5
    assert spool.threads and all(name.startswith("ledger-spool") for name in spool.threads)
    assert [e.request_id for e in _read(tmp_path / "ledger-w.jsonl")] == [f"r{i}" for i in range(5)]


def test_events_nothing_can_take_are_held_up_to_the_bound_then_counted_as_dropped(tmp_path):
    (tmp_path / "spool").write_text("a file where the spool's directory should be")
    writer = _unreachable_writer(Spool(tmp_path / "spool", "w"), max_queue=3, max_held=2)

    async def main():
        writer.start()
        for i in range(8):
            writer.emit(_event(f"r{i}"))
        await writer.flush()
        held = (writer.queue_depth, writer.events_dropped, writer.spool_down, writer.spool_failures)
        await writer.close()  # still nothing takes them: lost, and counted
        return held

    depth, dropped, spool_down, failures = asyncio.run(main())
    assert (depth, dropped, spool_down) == (5, 3, True) and failures >= 1
    assert writer.events_dropped == 8 and writer.queue_depth == 0


def test_what_the_queue_holds_beyond_its_bound_goes_to_the_spool_without_a_flush(tmp_path):
    writer = _unreachable_writer(Spool(tmp_path, "w"), max_queue=3, max_held=10)

    async def main():
        writer.start()
        for i in range(7):
            writer.emit(_event(f"r{i}"))
        for _ in range(500):
            if writer.spool.events == 4:
                break
            await asyncio.sleep(0.01)
        state = (writer.queue_depth, writer.spool.events)
        await writer.close()
        return state

    assert asyncio.run(main()) == (3, 4)
    assert sorted(e.request_id for e in _read(tmp_path / "ledger-w.jsonl")) == [f"r{i}" for i in range(7)]
