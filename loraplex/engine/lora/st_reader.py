"""Zero-copy reading of a safetensors file: one read, a header of plain integers, views made only on demand.

Adapter loads sit on the request path (a cold adapter is read while its request waits), so:
- the file is read once, into an uninitialised buffer (a zero-filled bytearray costs as much again as the
  read) or a recycled one (fresh pages cost a page fault each: on a VM as slow as the read), never copied;
- a file the page cache does not wholly hold is read from the disk with O_DIRECT, straight into that
  buffer: the copy that lasts is the slots' CPU tier, not the page cache;
- the header is checked as plain Python values, without a torch object per tensor (an adapter has
  hundreds); callers take views of the data region, and when every tensor shares one dtype the region is
  one flat tensor that a single reduction checks for NaN/Inf;
- a header is parsed once per distinct header (`_entries`): adapters of one shape have identical ones.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import math
import mmap
import os
import struct
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from types import MappingProxyType
from typing import NamedTuple

import torch

DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}


class Entry(NamedTuple):
    """One tensor of the file: its dtype, shape and byte range [begin, end) in the data region."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def parse_safetensors(data: torch.Tensor) -> tuple[Mapping[str, Entry], torch.Tensor]:
    """Returns ({name: Entry} (read-only), the data region as a flat uint8 view of `data`).

    `data` is the file's bytes, a flat uint8 tensor (read_file). Raises ValueError for anything
    that is not a well-formed safetensors buffer.
    """
    if data.dtype != torch.uint8 or data.dim() != 1:
        raise TypeError("data must be a flat uint8 tensor (read_file)")
    if len(data) < 8:
        raise ValueError("file is shorter than the 8-byte header length")
    raw = data.numpy()
    (header_len,) = struct.unpack("<Q", raw[:8].tobytes())
    if header_len > len(data) - 8:
        raise ValueError(f"header length {header_len} runs past the end of the file")
    region = data[8 + header_len:]
    return _entries(raw[8:8 + header_len].tobytes(), len(region)), region


# Adapters trained for one base model with one config have byte-identical headers (the same names,
# shapes and offsets), so a fleet's loads parse one header once: parsing and checking an adapter's
# hundreds of entries cost 1-1.5 ms of a 5-7 ms load on the Zen 4 VM. (Errors are not cached.)
@functools.lru_cache(maxsize=32)
def _entries(header_bytes: bytes, size: int) -> Mapping[str, Entry]:
    """The header's entries, each checked to lie within a data region of `size` bytes."""
    try:
        header = json.loads(header_bytes)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    entries: dict[str, Entry] = {}
    for name, info in header.items():  # plain comparisons: this runs for each of an adapter's hundreds of tensors
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = DTYPES[info["dtype"]], info["shape"], info["data_offsets"]
            nbytes = dtype.itemsize
            for d in shape:
                if type(d) is not int:
                    raise TypeError
                nbytes *= d
            if type(shape) is not list or type(begin) is not int or type(end) is not int:
                raise TypeError
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"tensor {name!r} has a malformed header entry") from None
        if not 0 <= begin <= end <= size or end - begin != nbytes or min(shape, default=0) < 0:
            raise ValueError(f"tensor {name!r} has data offsets [{begin}, {end}) that do not fit the file")
        entries[name] = Entry(dtype, tuple(shape), begin, end)
    return MappingProxyType(entries)  # shared between the loads of one cache entry: read-only


def view(region: torch.Tensor, entry: Entry) -> torch.Tensor:
    """The tensor `entry` describes: a view of the region where its dtype's alignment allows, else a copy."""
    item = entry.dtype.itemsize
    if (region.storage_offset() + entry.begin) % item == 0:
        return region[entry.begin:entry.end].view(entry.dtype).view(entry.shape)
    return region[entry.begin:entry.end].clone().view(entry.dtype).view(entry.shape)


def flat_view(region: torch.Tensor, entries: Mapping[str, Entry]) -> torch.Tensor | None:
    """The whole region as one flat tensor of the entries' single dtype, when they share one, tile the
    region exactly (no gaps: every value in it belongs to a tensor) and the region is aligned; else None."""
    dtypes = {e.dtype for e in entries.values()}
    if len(dtypes) != 1 or not len(region):
        return None
    (dtype,) = dtypes
    if sum(e.end - e.begin for e in entries.values()) != len(region) \
            or region.storage_offset() % dtype.itemsize or any(e.begin % dtype.itemsize for e in entries.values()):
        return None
    return region.view(dtype)


# Files at least this large are read in two halves at once: one core's copy out of the page cache
# runs well under the memory's bandwidth (measured on a 2-core VM: 3.5 ms for 19.5 MB alone, 2.6 ms
# in two halves).
SPLIT_READ_BYTES = 4 << 20
# A file the page cache does not wholly hold is read with O_DIRECT, into memory aligned to this (a
# multiple of any disk's logical block): the disk's DMA lands in the buffer, with no page-cache pages to
# allocate, fill and copy. On the Zen 3 VM's virtio disk, cold 19.5 MB adapters read so took 0.47-1.02
# of the plain read's time (medians over runs of 9-36 files taking turns), and at most 25 ms where the
# plain read took up to 38 (bench/RESULTS.md's git history, seventeenth session).
DIRECT_ALIGN = 4096


@functools.cache
def _reader() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="loraplex-read")


def read_file(path, into: torch.Tensor | None = None) -> torch.Tensor:
    """The whole file as a flat uint8 tensor: copied from the page cache when it holds all of it, else
    read straight from the disk (O_DIRECT). The bytes go into uninitialised memory, or into `into` (a flat
    uint8 buffer to recycle) when the file fits in it; either way they start on a DIRECT_ALIGN boundary."""
    with open(path, "rb", buffering=0) as f:
        fd = f.fileno()
        size = os.fstat(fd).st_size
        data = _aligned(size, into)
        buf = memoryview(data.numpy())  # the file's bytes, then room up to a whole block
        data = data[:size]
        direct = None if _wholly_cached(fd, size) else _open_direct(path)
        half = size // 2 // DIRECT_ALIGN * DIRECT_ALIGN if size >= SPLIT_READ_BYTES else size
        second = _reader().submit(_read_range, fd, direct, buf, half, size, size) if half < size else None
        try:
            _read_range(fd, direct, buf, 0, half, size)
        finally:
            if second is not None:
                second.result()  # (before the files close, even when the first half failed)
            if direct is not None:
                os.close(direct)
    return data


def _aligned(size: int, into: torch.Tensor | None) -> torch.Tensor:
    """A flat uint8 tensor of `size` bytes rounded up to DIRECT_ALIGN, starting on a DIRECT_ALIGN
    boundary: a part of `into` when it has room, else new uninitialised memory."""
    need = -(-size // DIRECT_ALIGN) * DIRECT_ALIGN
    if into is not None and into.dtype == torch.uint8 and into.dim() == 1 and into.is_contiguous():
        skip = -into.data_ptr() % DIRECT_ALIGN
        if skip + need <= len(into):
            return into[skip:skip + need]
    fresh = torch.empty(need + DIRECT_ALIGN, dtype=torch.uint8)
    skip = -fresh.data_ptr() % DIRECT_ALIGN
    return fresh[skip:skip + need]


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in
                ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


_SYS_CACHESTAT = 451  # Linux 6.5 and later, the same number on every architecture's table


@functools.cache
def _syscall():
    """libc's syscall() through ctypes, or None where there is none."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        return libc.syscall
    except (OSError, AttributeError):
        return None


def _wholly_cached(fd: int, size: int) -> bool:
    """Whether the page cache holds every page of the file; True where that cannot be told (the plain
    read is always right) or there is no direct I/O to read it otherwise."""
    if size == 0 or not hasattr(os, "O_DIRECT"):
        return True
    resident = resident_pages(fd)
    return resident is None or resident >= -(-size // mmap.PAGESIZE)


def resident_pages(fd: int) -> int | None:
    """How many of the file's pages the page cache holds (the cachestat system call, which starts no
    read), or None where that cannot be told (a kernel before 6.5). Asking with a read that may not
    wait (RWF_NOWAIT) starts the readahead it misses: on the Zen 3 VM, 16 MB of a 19.5 MB file, read
    again by O_DIRECT; mincore over a mapping of the file took 0.73 ms, cachestat 0.16."""
    syscall = _syscall()
    if syscall is None:
        return None
    stat = _Cachestat()
    whole = _CachestatRange(0, 0)  # len 0: to the file's end
    if syscall(_SYS_CACHESTAT, fd, ctypes.byref(whole), ctypes.byref(stat), 0) != 0:
        return None
    return stat.nr_cache


def drop_from_page_cache(path) -> None:
    """Writes the file back and drops its pages from the page cache, so its next read comes from the disk
    (a file unread for a while; `loraplex bench lora` times cold loads so). Linux (posix_fadvise)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _open_direct(path) -> int | None:
    """A second descriptor of the file, opened with O_DIRECT; None where the file system has none."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECT)  # (non-inheritable, as every os.open)
    except OSError:  # EINVAL: a file system without direct I/O
        return None


def _read_range(fd: int, direct: int | None, buf: memoryview, begin: int, end: int, size: int) -> None:
    """Bytes [begin, end) of the file (end <= size) into the same bytes of buf (pread: no shared file
    position), with O_DIRECT through `direct` when given: begin is a block boundary, and so is end
    unless it is the file's end, where the read takes the last block whole (buf has room for it). A
    failed direct read (a file system that refuses one) leaves the rest to a plain read."""
    got = begin
    if direct is not None:
        with contextlib.suppress(OSError):  # (got stays begin)
            got = min(_pread(direct, buf, got, len(buf) if end == size else end, stop=end), end)
    got = _pread(fd, buf, got, end)
    if got < end:
        raise ValueError(f"file ended after {got} of {size} bytes (changed while read)")


def _pread(fd: int, buf: memoryview, got: int, end: int, stop: int | None = None) -> int:
    """Reads the file from byte `got` on into buf[got:end] until `stop` (default end) or the file's end;
    returns where it stopped."""
    stop = end if stop is None else stop
    while got < stop:
        n = os.preadv(fd, [buf[got:end]], got)
        if not n:
            break
        got += n
    return got
