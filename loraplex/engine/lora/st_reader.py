"""Zero-copy reading of a safetensors file: one read, a header of plain integers, views made only on demand.

Adapter loads sit on the request path (a cold adapter is read while its request waits), so the
file is read once, into an uninitialised buffer (a zero-filled bytearray costs as much again as
the read) or into a recycled one (fresh pages cost a page fault each: on a VM that is as slow as the
read itself), and never copied again. The header is checked as plain Python values, without a torch
object per tensor (an adapter has hundreds, and per-tensor views cost more than the read): callers
that need tensors take views of the data region, and when every tensor shares one dtype the whole
region is one flat tensor that a single reduction can check for NaN/Inf. A header is parsed once
per distinct header (`_entries`): adapters of one shape have byte-identical ones.
"""

from __future__ import annotations

import functools
import json
import math
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


@functools.cache
def _reader() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="loraplex-read")


def read_file(path, into: torch.Tensor | None = None) -> torch.Tensor:
    """The whole file as a flat uint8 tensor, read straight into uninitialised memory, or into the
    front of `into` (a flat uint8 buffer to recycle) when the file fits in it."""
    with open(path, "rb", buffering=0) as f:
        fd = f.fileno()
        size = os.fstat(fd).st_size
        if into is not None and into.dtype == torch.uint8 and into.dim() == 1 and len(into) >= size:
            data = into[:size]
        else:
            data = torch.empty(size, dtype=torch.uint8)
        buf = memoryview(data.numpy())
        half = size // 2 if size >= SPLIT_READ_BYTES else size
        second = _reader().submit(_read_range, fd, buf, half, size) if half < size else None
        try:
            _read_range(fd, buf, 0, half)
        finally:
            if second is not None:
                second.result()  # (before the file closes, even when the first half failed)
    return data


def _read_range(fd: int, buf: memoryview, begin: int, end: int) -> None:
    """Bytes [begin, end) of the file into the same bytes of buf (pread: no shared file position)."""
    got = begin
    while got < end:
        n = os.preadv(fd, [buf[got:end]], got)
        if not n:
            raise ValueError(f"file ended after {got} of {len(buf)} bytes (changed while read)")
        got += n
