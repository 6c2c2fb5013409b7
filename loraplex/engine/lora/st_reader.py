"""Zero-copy reading of a safetensors file: one read, tensors as views into that one buffer.

Adapter loads sit on the request path (a cold adapter is read while its request waits), so the
file is read once, into an uninitialised buffer (a zero-filled bytearray costs as much again as
the read), and never copied again: the tensors are strided views of it, one op each, and when every
tensor shares one dtype the whole data region is one flat tensor that a single reduction can check
for NaN/Inf.
"""

from __future__ import annotations

import json
import math
import os
import struct

import torch

DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}


def read_safetensors(data: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """Returns ({name: view}, flat view of the whole data region or None when dtypes differ).

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
    try:
        header = json.loads(raw[8:8 + header_len].tobytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    start = 8 + header_len
    size = len(data) - start
    region = data[start:]
    typed: dict[torch.dtype, torch.Tensor | None] = {}  # the data region as each dtype, when aligned to it
    strides: dict[tuple[int, ...], list[int]] = {}  # contiguous strides per shape (adapters repeat a few)
    tensors: dict[str, torch.Tensor] = {}
    covered = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[info["dtype"]]
            shape = tuple(map(int, info["shape"]))
            begin, end = map(int, info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"tensor {name!r} has a malformed header entry") from None
        item = dtype.itemsize
        nbytes = math.prod(shape) * item
        if not (0 <= begin <= end <= size) or end - begin != nbytes or min(shape, default=0) < 0:
            raise ValueError(f"tensor {name!r} has data offsets [{begin}, {end}) that do not fit the file")
        if dtype not in typed:
            typed[dtype] = region[:size - size % item].view(dtype) if start % item == 0 else None
        whole = typed[dtype]
        if whole is not None and begin % item == 0:  # a view: one op (the offset counts from the storage's start)
            if shape not in strides:
                strides[shape] = _contiguous_strides(shape)
            tensors[name] = whole.as_strided(shape, strides[shape], whole.storage_offset() + begin // item)
        else:  # misaligned for its dtype: a copy of its bytes
            tensors[name] = region[begin:end].clone().view(dtype).view(shape)
        covered += nbytes
    flat = None
    if len(typed) == 1 and covered == size and size:
        (flat,) = typed.values()
    return tensors, flat


def _contiguous_strides(shape: tuple[int, ...]) -> list[int]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return strides[::-1]


def read_file(path) -> torch.Tensor:
    """The whole file as a flat uint8 tensor, read straight into uninitialised memory."""
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        data = torch.empty(size, dtype=torch.uint8)
        view = memoryview(data.numpy())
        got = 0
        while got < size:
            n = f.readinto(view[got:])
            if not n:
                raise ValueError(f"file ended after {got} of {size} bytes (changed while read)")
            got += n
    return data
