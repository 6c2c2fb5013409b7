"""Zero-copy reading of a safetensors file: one read, tensors as views into that one buffer.

Adapter loads sit on the request path (a cold adapter is read while its request waits), so the
file is read once and never copied again: the tensors are views, and when every tensor shares one
dtype the whole data region is one flat tensor that a single reduction can check for NaN/Inf.
"""

from __future__ import annotations

import json
import math
import struct

import torch

DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}


def read_safetensors(data: bytearray) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """Returns ({name: view}, flat view of the whole data region or None when dtypes differ).

    Raises ValueError for anything that is not a well-formed safetensors buffer.
    """
    if len(data) < 8:
        raise ValueError("file is shorter than the 8-byte header length")
    (header_len,) = struct.unpack("<Q", data[:8])
    if header_len > len(data) - 8:
        raise ValueError(f"header length {header_len} runs past the end of the file")
    try:
        header = json.loads(bytes(data[8:8 + header_len]))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    start = 8 + header_len
    size = len(data) - start
    tensors: dict[str, torch.Tensor] = {}
    dtypes = set()
    covered = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[info["dtype"]]
            shape = [int(d) for d in info["shape"]]
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"tensor {name!r} has a malformed header entry") from None
        nbytes = math.prod(shape) * dtype.itemsize
        if not (0 <= begin <= end <= size) or end - begin != nbytes:
            raise ValueError(f"tensor {name!r} has data offsets [{begin}, {end}) that do not fit the file")
        flat = torch.frombuffer(data, dtype=dtype, count=nbytes // dtype.itemsize, offset=start + begin) \
            if nbytes else torch.empty(0, dtype=dtype)
        tensors[name] = flat.view(shape)
        dtypes.add(dtype)
        covered += nbytes
    whole = None
    if len(dtypes) == 1 and covered == size and size:
        (dtype,) = dtypes
        whole = torch.frombuffer(data, dtype=dtype, count=size // dtype.itemsize, offset=start)
    return tensors, whole


def read_file(path) -> bytearray:
    """The whole file in one writable buffer (torch.frombuffer wants one), read without a second copy."""
    with open(path, "rb") as f:
        f.seek(0, 2)
        buf = bytearray(f.tell())
        f.seek(0)
        f.readinto(buf)
    return buf
