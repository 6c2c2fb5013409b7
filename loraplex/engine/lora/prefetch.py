"""Adapter loads off the step's path: LoraSlots' disk and CPU tiers, read in the background, copied without blocking.

- CpuTiers: the part of LoraSlots that reads adapters from disk (on the caller's thread, or with
  `background` reads on the loader thread, parked until their first acquire) and keeps the CPU tier.
- AdapterLoader: one worker thread that reads adapters from disk (parse, validate, stage) while steps run,
  so that `LoraSlots.acquire` never waits on a disk read (it answers "not ready" meanwhile).
- StagedAdapter: an adapter in the slots' layout and dtype (pinned on CUDA): per (layer, fused module) its A
  rows [S, r, in] and scaled B rows [r, out_total] (rank-major, as the slot buffers store B).
- copy_staged: writes one into a slot. On CUDA: one non-blocking host-to-device copy and device-side
  copies on a side stream, fenced by an event the current (step) stream waits on; the host never blocks.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from loraplex.engine.lora.peft import AdapterError, LoraWeights, files_version, load_peft_adapter

_streams: dict[torch.device, torch.cuda.Stream] = {}
_streams_lock = threading.Lock()


@dataclass
class StagedAdapter:
    """An adapter as a slot holds it, in one flat tensor (pinned on CUDA): what a slot write copies as is."""

    rank: int  # rows of A (per slice) and of B held per (layer, fused module)
    flat: torch.Tensor = field(repr=False)  # [elements], the slots' dtype
    # (layer, fused module) -> (start of its A [S, rank, in], start of its B [rank, out_total]) in flat;
    # absent: the adapter leaves every module of that fused projection alone (the slot rows are zeroed)
    parts: dict[tuple[int, str], tuple[int, int]] = field(repr=False)


def stage_adapter(lora: LoraWeights, rows: dict[str, list[tuple[str, int, int]]], in_features: dict[str, int],
                  num_layers: int, dtype: torch.dtype, pin: bool) -> StagedAdapter:
    """The adapter in the slots' layout and dtype: A as is, B transposed and scaled (in fp32, rounded once
    to `dtype`, as LoraSlots' direct write does), zeros above each module's own rank. `rows`: per fused
    module, (module, row offset, width) of its slices (peft.fused_rows); `pin`: in pinned memory."""
    r, parts, size = lora.rank, {}, 0
    for layer in range(num_layers):
        for f, slices in rows.items():
            if any((layer, m) in lora.offsets for m, _, _ in slices):
                a_size = len(slices) * r * in_features[f]
                parts[(layer, f)] = (size, size + a_size)
                size += a_size + r * sum(w for _, _, w in slices)
    flat = torch.zeros(size, dtype=dtype, pin_memory=pin)
    for (layer, f), (a_at, b_at) in parts.items():
        slices, in_f = rows[f], in_features[f]
        out_total = sum(w for _, _, w in slices)
        a = flat[a_at:a_at + len(slices) * r * in_f].view(len(slices), r, in_f)  # [S, r, in]
        b = flat[b_at:b_at + r * out_total].view(r, out_total)  # [r, out_total]
        for s, (m, off, width) in enumerate(slices):
            if (layer, m) not in lora.offsets:
                continue
            k = lora.rank_of(layer, m)
            a[s, :k] = lora.a(layer, m)  # [k, in]
            b[:k, off:off + width] = (lora.b(layer, m) * lora.scaling_of(layer, m)).t()  # [k, width]
    return StagedAdapter(r, flat, parts)


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One stream per device for slot writes, beside the step's stream."""
    with _streams_lock:
        stream = _streams.get(device)
        if stream is None:
            stream = _streams[device] = torch.cuda.Stream(device=device)
        return stream


def copy_staged(image: StagedAdapter, buffers: tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]],
                slot: int, r_max: int, dirty: int, rows: dict[str, list[tuple[str, int, int]]]) -> None:
    """Overwrites `slot` of the stacked buffers (LoraSlots._buffers: per layer, fused module -> A
    [slots, S * r_max, in] and B [slots, out_total, r_max] rank-major) with `image`, zeroing the rows up to
    `dirty` (the slot's dirty rank) that the image does not cover.

    On CUDA nothing here waits on the device: the side stream first waits for the work already queued on
    the current stream (a step may still read the slot's old rows), copies, and records an event that the
    current stream waits on before the next step's kernels read the slot."""
    device = buffers[0][0][next(iter(rows))].device
    cuda = device.type == "cuda"
    current = torch.cuda.current_stream(device) if cuda else None
    side = _side_stream(device) if cuda else None
    with torch.cuda.device(device) if cuda else nullcontext(), torch.cuda.stream(side) if cuda else nullcontext():
        if cuda:
            side.wait_stream(current)
        # one copy from pinned memory; allocated on the side stream, so its memory is reused only after it
        src = image.flat.to(device, non_blocking=True) if cuda else image.flat  # [elements]
        r = image.rank
        for layer, (a_layer, b_layer) in enumerate(zip(*buffers, strict=True)):
            for f, slices in rows.items():
                s = len(slices)
                a = a_layer[f][slot].view(s, r_max, -1)  # [S, r_max, in]
                b = b_layer[f][slot].t()  # [r_max, out_total]: B's rank-major storage
                part, live = image.parts.get((layer, f)), 0
                if part is not None:
                    live = r
                    a[:, :r].copy_(src[part[0]:part[0] + a[:, :r].numel()].view(s, r, a.shape[2]), non_blocking=cuda)
                    b[:r].copy_(src[part[1]:part[1] + r * b.shape[1]].view(r, b.shape[1]), non_blocking=cuda)
                if dirty > live:
                    a[:, live:dirty].zero_()
                    b[live:dirty].zero_()
        if cuda:
            done = torch.cuda.Event()
            done.record(side)
    if cuda:
        current.wait_event(done)


class AdapterLoader:
    """A single background thread for adapter reads: one at a time, in the order asked (FIFO)."""

    def __init__(self):
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], None]):
        """Runs `job` on the loader thread (started on first use); returns its Future."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-prefetch")
            return self._pool.submit(job)

    def shutdown(self) -> None:
        """Stops the thread after the jobs already queued (for callers that want it gone now)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


class Registration(NamedTuple):
    path: str  # the PEFT directory
    number: int  # unique over the slots' life (LoraSlots.registration)
    version: tuple  # peft.files_version() of the files as registered


def changed(adapter_id: str, registration: Registration) -> AdapterError:
    return AdapterError(f"adapter {adapter_id!r}: its files in {registration.path!r} changed since it was registered; "
                        "a new version belongs in a new directory, registered as a new adapter (registering this "
                        "one again serves the files as they are now)")


class CpuTiers:
    """LoraSlots' disk and CPU tiers: registered adapters read (synchronously, or by the loader thread),
    kept parsed (and staged, on CUDA) in an LRU CPU tier. Uses LoraSlots' lock, registry and slots."""

    def _init_tiers(self, background: bool) -> None:
        """The tiers' state (called by LoraSlots.__init__, after its lock, registry and slot state)."""
        self._cpu: OrderedDict[str, LoraWeights] = OrderedDict()  # CPU tier, least recently used first
        # The file buffer of the latest adapter to leave the CPU tier, for the next disk read to reuse:
        # fresh pages cost a page fault each (on a VM, as much as the read itself). It is reused only by a
        # later read under the lock, after the dropped adapter's last use (a slot write in the same call).
        self._spare: torch.Tensor | None = None
        self.background = background  # disk reads on the loader thread only: acquire never blocks on one
        self._staged = self.device.type == "cuda"  # the CPU tier keeps pinned slot images (_images)
        self._images: dict[str, StagedAdapter] = {}  # adapter in the CPU tier -> its slot image
        self._loader = AdapterLoader()
        self._pending: dict[str, object] = {}  # adapter -> the token of its background read in flight
        # Background reads done, awaiting their first acquire (LRU beyond max(max_loras, max_cpu_loras)).
        self._ready: OrderedDict[str, tuple[LoraWeights, StagedAdapter | None]] = OrderedDict()
        self._load_errors: dict[str, AdapterError] = {}  # background reads that failed: the next acquire raises
        self.reads_done = 0  # background reads ended (read, failed or dropped): a waiting step may run again
        self.on_read: Callable[[], None] = lambda: None  # called by the loader thread after each (wakes the engine)

    def prefetch(self, adapter_id: str) -> bool:
        """Starts reading the adapter into the CPU tier in the background, unless it is in a slot, in the
        CPU tier, read already or being read (or not registered). Returns whether a read is in flight."""
        with self._lock:
            registration = self._registered.get(adapter_id)
            if registration is None or self._resident(adapter_id) or adapter_id in self._ready:
                return False
            if adapter_id not in self._pending:
                self._load_errors.pop(adapter_id, None)  # (read again: the files may be back)
                token = self._pending[adapter_id] = object()
                self._loader.submit(lambda: self._load_in_background(adapter_id, registration, token))
            return True

    def loading(self, adapter_id: str | None = None) -> bool:
        """Whether a background read of the adapter (None: of any adapter) is in flight."""
        return bool(self._pending) if adapter_id is None else adapter_id in self._pending

    def _resident(self, adapter_id: str) -> bool:
        """Whether the adapter is in a slot or in the CPU tier: a slot load then needs no disk read."""
        return adapter_id in self._loaded or adapter_id in self._cpu

    def _stage(self, lora: LoraWeights) -> StagedAdapter | None:
        """The adapter's slot image, where the CPU tier keeps them (on CUDA, pinned); else None."""
        if not self._staged:
            return None
        return stage_adapter(lora, self._rows, self._in, self.config.num_layers, self.dtype,
                             pin=self.device.type == "cuda")

    def _remember(self, adapter_id: str, lora: LoraWeights, image: StagedAdapter | None) -> None:
        """Puts the adapter in the CPU tier as most recently used, dropping the LRU beyond capacity."""
        ready = self._ready.pop(adapter_id, None)  # (a background read that a synchronous one overtook)
        if ready is not None and ready[0] is not lora:
            self._recycle(ready[0])
        self._cpu[adapter_id] = lora
        self._cpu.move_to_end(adapter_id)
        if image is not None:
            self._images[adapter_id] = image
        while len(self._cpu) > self.max_cpu_loras:
            self._forget(next(iter(self._cpu)))

    def _forget(self, adapter_id: str) -> None:
        """Drops the adapter from the CPU tier and the background reads done (its buffer becomes the spare)."""
        self._images.pop(adapter_id, None)
        for tier in (self._cpu, self._ready):
            dropped = tier.pop(adapter_id, None)
            if dropped is not None:
                self._recycle(dropped if isinstance(dropped, LoraWeights) else dropped[0])

    def _read(self, path: str | Path) -> LoraWeights:
        """Parses and validates the adapter from disk, into the spare buffer when it fits. Called under the
        lock, or (background reads) without it: the spare is taken and given back under the lock."""
        with self._lock:
            spare, self._spare = self._spare, None
        try:
            lora = load_peft_adapter(path, self.config, self.max_lora_rank, buffer=spare)
        except BaseException:
            self._keep_spare(spare)
            raise
        if spare is not None and (lora.buffer is None
                                  or lora.buffer.untyped_storage().data_ptr() != spare.data_ptr()):
            self._keep_spare(spare)  # not used: the file was larger, or its values were converted
        return lora

    def _recycle(self, lora: LoraWeights) -> None:
        """Keeps the file buffer of an adapter leaving the CPU tier as the spare, when larger than the spare."""
        if lora.buffer is not None:
            self._keep_spare(torch.empty(0, dtype=torch.uint8).set_(lora.buffer.untyped_storage()))  # all of it

    def _keep_spare(self, whole: torch.Tensor | None) -> None:
        """Makes `whole` (a flat uint8 file buffer no adapter uses) the spare when it is the larger."""
        with self._lock:
            if whole is not None and (self._spare is None or len(whole) > len(self._spare)):
                self._spare = whole

    def _load_in_background(self, adapter_id: str, registration: Registration, token: object) -> None:
        """The loader thread's job: reads, validates and stages the adapter without the lock, then parks it
        for its first acquire (or its error), unless it was unregistered (or read again) meanwhile."""
        lora = image = error = None
        try:
            lora = self._read_registered(adapter_id, registration)
            image = self._stage(lora)
        except AdapterError as e:
            error = e
        except Exception as e:  # (any failure ends the adapter's requests, never leaves them waiting)
            error = AdapterError(f"adapter {adapter_id!r}: reading {registration.path!r} failed: {e}")
        with self._lock:
            self._park(adapter_id, registration, token, lora, image, error)
            self.reads_done += 1
        self.on_read()

    def _park(self, adapter_id: str, registration: Registration, token: object, lora: LoraWeights | None,
              image: StagedAdapter | None, error: AdapterError | None) -> None:
        """A finished read's result, kept for the adapter's first acquire (under the lock)."""
        if self._pending.get(adapter_id) is not token or self._registered.get(adapter_id) is not registration:
            if lora is not None:
                self._recycle(lora)
            return
        del self._pending[adapter_id]
        if error is not None:
            self._load_errors[adapter_id] = error
            return
        self._ready[adapter_id] = (lora, image)
        while len(self._ready) > max(self.max_loras, self.max_cpu_loras):
            self._forget(next(iter(self._ready)))  # (read again when asked for)

    def _read_registered(self, adapter_id: str, registration: Registration) -> LoraWeights:
        """The adapter re-read from disk and re-validated. A registration serves the files as they were when
        registered: once they change, its KV in the prefix cache and the weights in use elsewhere would
        disagree with them, so the adapter's requests fail (naming it) until it is registered again. Checked
        before the read (a request for a changed adapter then costs two stats, not a read; a missing file:
        the read says which) and after it (a change in between)."""
        now = files_version(Path(registration.path))
        if None not in now and now != registration.version:
            raise changed(adapter_id, registration)
        lora = self._read(registration.path)
        if lora.version != registration.version:
            self._recycle(lora)
            raise changed(adapter_id, registration)
        return lora

    def _weights(self, adapter_id: str) -> tuple[LoraWeights, StagedAdapter | None]:
        """The adapter and its slot image: from the CPU tier, a background read, or (synchronous) the disk."""
        lora = self._cpu.get(adapter_id)
        if lora is not None:
            self.stats.cpu_hits += 1
            self._cpu.move_to_end(adapter_id)
            return lora, self._images.get(adapter_id)
        ready = self._ready.pop(adapter_id, None)
        if ready is not None:
            self.stats.disk_loads += 1
            self._remember(adapter_id, *ready)
            return ready
        lora = self._read_registered(adapter_id, self._registered[adapter_id])
        image = self._stage(lora)
        self.stats.disk_loads += 1
        self._remember(adapter_id, lora, image)
        return lora, image
