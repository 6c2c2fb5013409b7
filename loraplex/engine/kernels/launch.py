"""Launching Triton kernels on the device their tensors live on.

A Triton launch goes to the current CUDA device, not the tensors' own: without a guard, a model on
cuda:1 would launch its kernels on device 0 and read foreign memory.
"""

from __future__ import annotations

import contextlib

import torch


def on_device(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Makes t's CUDA device current for the launches inside; nothing on the CPU (the interpreter)."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()
