"""A step's index lists sent to the device in one copy: one tensor, from pinned memory on CUDA, queued without waiting.

Why: a copy from pageable memory may make the host wait for the device's queued work while the driver stages it,
which would undo asynchronous scheduling; a copy from pinned memory is queued like a kernel. (The caching host
allocator keeps a pinned block from reuse until the copy that reads it is done.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def upload(device: torch.device, dtype: torch.dtype, *parts: Sequence[int]) -> list[torch.Tensor]:
    """Each list of ints as a 1-D `dtype` tensor on `device`, views of one tensor sent in one copy."""
    flat = torch.tensor([x for part in parts for x in part], dtype=dtype, pin_memory=device.type == "cuda")
    if device.type != "cpu":
        flat = flat.to(device, non_blocking=True)
    return list(flat.split([len(part) for part in parts]))
