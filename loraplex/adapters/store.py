"""Content-addressed storage for uploaded adapters.

Why: the engine refuses an adapter whose files changed since it was registered, and every instance
that serves an adapter must read the same bytes. So an uploaded file is kept under its SHA-256 and
never written again, and an adapter is a directory of hard links to its two files' blobs, named by
the digest of its manifest: files cannot change under a registration, a half-written upload is
never visible, and the same files registered twice (by two tenants, say) are stored once.

Layout under the root (several instances share it when it lies on a shared file system mounted at
the same path on each, since adapter rows name their directory by its path):

    blobs/sha256/<hex>     one uploaded file, read-only
    adapters/<hex>/        adapter_config.json, adapter_model.safetensors (links to their blobs) and
                           manifest.json; <hex> is the SHA-256 of the manifest
    tmp/                   uploads and directories being written, renamed into place once whole

`collect` removes what no adapter row names any more, once it is older than a grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import json
import os
import re
import secrets
import shutil
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from loraplex.engine.api import PEFT_FILES

_DIGEST = re.compile(r"sha256:([0-9a-f]{64})")  # matched whole
_WRITE_CHUNK = 1 << 20  # bytes gathered before a write (and hash) on a worker thread


class StoreError(Exception):
    """A request the store cannot serve. `code`: invalid_digest, digest_mismatch, too_large,
    blob_missing, invalid_files (the caller's mistakes) or no_space, storage_error (the server's)."""

    def __init__(self, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


@dataclass(frozen=True)
class Blob:
    digest: str  # "sha256:<hex>"
    size: int


@dataclass(frozen=True)
class Collected:
    adapters: int  # directories removed
    blobs: int
    bytes_freed: int  # of the blobs and unfinished uploads removed


def parse_digest(text: str, param: str = "digest") -> str:
    """The hex of a "sha256:<64 hex digits>" digest (case-insensitive)."""
    match = _DIGEST.fullmatch(text.strip().lower())
    if match is None:
        raise StoreError("invalid_digest", f"{text!r} is not a digest: expected sha256:<64 hex digits>", param)
    return match.group(1)


def file_digest(path: Path) -> str:
    """ "sha256:<hex>" of a file's bytes, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_WRITE_CHUNK):
            h.update(chunk)
    return f"sha256:{h.hexdigest()}"


class AdapterStore:
    def __init__(self, root: Path, max_blob_bytes: int):
        self.root = Path(root)
        self.max_blob_bytes = max_blob_bytes

    def blob(self, digest: str) -> Blob | None:
        """The stored blob of that digest, or None."""
        hex_ = parse_digest(digest)
        try:
            size = self._blob_path(hex_).stat().st_size
        except FileNotFoundError:
            return None
        return Blob(f"sha256:{hex_}", size)

    async def receive(self, digest: str, chunks: AsyncIterator[bytes], announced_size: int | None = None) -> Blob:
        """Streams one upload to a temporary file, hashing as it goes, and publishes it under its
        digest only if the bytes match it. Whatever fails leaves nothing behind."""
        hex_ = parse_digest(digest)
        if announced_size is not None and announced_size > self.max_blob_bytes:
            raise self._too_large()
        tmp = self._tmp_path("blob")
        h, size, pending, pending_size = hashlib.sha256(), 0, [], 0
        try:
            with _storage_errors(), open(tmp, "xb") as f:
                async for chunk in chunks:
                    size += len(chunk)
                    if size > self.max_blob_bytes:
                        raise self._too_large()
                    pending.append(chunk)
                    pending_size += len(chunk)
                    if pending_size >= _WRITE_CHUNK:
                        await asyncio.to_thread(_write, f, h, pending)
                        pending, pending_size = [], 0
                await asyncio.to_thread(_write, f, h, pending, True)
            if h.hexdigest() != hex_:
                raise StoreError("digest_mismatch", f"the body's digest is sha256:{h.hexdigest()}, not {digest}",
                                 "digest")
            with _storage_errors():
                await asyncio.to_thread(self._publish, tmp, self._blob_path(hex_))
        finally:
            tmp.unlink(missing_ok=True)
        return Blob(f"sha256:{hex_}", size)

    def adapter_dir(self, files: Mapping[str, str]) -> Path:
        """The directory holding these blobs under the adapter's file names, made if it is new.
        `files` maps each of the PEFT file names to its blob's digest."""
        if sorted(files) != sorted(PEFT_FILES):
            raise StoreError("invalid_files", f"files must name exactly {' and '.join(PEFT_FILES)}, got "
                             f"{', '.join(sorted(files)) or 'none'}", "files")
        blobs = {}
        for name in PEFT_FILES:
            blob = self._blob_path(parse_digest(files[name], f"files.{name}"))
            if not blob.is_file():
                raise StoreError("blob_missing", f"{name}'s blob {files[name]} is not in the store: upload it "
                                 "first (PUT /admin/api/blobs/<digest>)", f"files.{name}")
            blobs[name] = blob
        manifest = json.dumps({name: f"sha256:{blob.name}" for name, blob in blobs.items()}, sort_keys=True,
                              indent=1).encode() + b"\n"
        final = self.root / "adapters" / hashlib.sha256(manifest).hexdigest()
        with _storage_errors():
            if final.is_dir():
                os.utime(final)  # in use again: `collect` counts a directory's age from here
                return final
            tmp = self._tmp_path("adapter")
            try:
                tmp.mkdir()
                for name, blob in blobs.items():
                    _link_or_copy(blob, tmp / name)
                (tmp / "manifest.json").write_bytes(manifest)
                _fsync_dir(tmp)
                final.parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.rename(tmp, final)
                except OSError:
                    if not final.is_dir():  # not another upload of the same files that came first
                        raise
                _fsync_dir(final.parent)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        return final

    def collect(self, referenced: Iterable[str | Path], min_age_s: float) -> Collected:
        """Removes adapter directories no row names, blobs no directory links, and unfinished
        uploads, each only once older than `min_age_s` (so a registration or upload under way,
        whose row is not written yet, keeps its files)."""
        keep = {Path(p).resolve() for p in referenced}
        cutoff = time.time() - min_age_s
        adapters = blobs = freed = 0
        for d in _children(self.root / "adapters"):
            if d.resolve() not in keep and d.stat().st_mtime < cutoff:
                shutil.rmtree(d)
                adapters += 1
        for b in _children(self.root / "blobs" / "sha256"):
            st = b.stat()
            if st.st_nlink == 1 and st.st_mtime < cutoff:  # no adapter directory links it
                b.unlink()
                blobs, freed = blobs + 1, freed + st.st_size
        for t in _children(self.root / "tmp"):
            st = t.stat()
            if st.st_mtime >= cutoff:
                continue
            if t.is_dir():
                shutil.rmtree(t)
            else:
                t.unlink()
                freed += st.st_size
        return Collected(adapters, blobs, freed)

    def _blob_path(self, hex_: str) -> Path:
        return self.root / "blobs" / "sha256" / hex_

    def _tmp_path(self, kind: str) -> Path:
        tmp = self.root / "tmp"
        with _storage_errors():
            tmp.mkdir(parents=True, exist_ok=True)
        return tmp / f"{kind}-{secrets.token_hex(8)}"

    def _too_large(self) -> StoreError:
        return StoreError("too_large", f"the file is larger than this server's limit of {self.max_blob_bytes} "
                          "bytes (LORAPLEX_ADAPTER_MAX_BYTES)", "digest")

    @staticmethod
    def _publish(tmp: Path, final: Path) -> None:
        """Read-only, then linked into place; a blob already there (the same bytes) stays as it is."""
        os.chmod(tmp, 0o444)
        final.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(tmp, final)
        except FileExistsError:
            return
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):
                raise
            if final.exists():
                return
            os.replace(tmp, final)  # a file system without hard links
        _fsync_dir(final.parent)


def _write(f, h, chunks: list[bytes], last: bool = False) -> None:
    for chunk in chunks:
        h.update(chunk)
        f.write(chunk)
    if last:
        f.flush()
        os.fsync(f.fileno())


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
            raise
        shutil.copyfile(source, target)
        os.chmod(target, 0o444)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _children(directory: Path) -> list[Path]:
    try:
        return list(directory.iterdir())
    except FileNotFoundError:
        return []


@contextlib.contextmanager
def _storage_errors() -> Iterator[None]:
    """OSErrors of the store's own disk as StoreErrors: a full disk says so; anything else is a
    storage error (the message names the errno, not our paths)."""
    try:
        yield
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StoreError("no_space", "the adapter store is out of space") from exc
        raise StoreError("storage_error", f"the adapter store failed: {os.strerror(exc.errno or 0)}") from exc
