"""Device slots for LoRA adapters of one base model: stacked kernel buffers, a registry, and two LRU tiers.

- Tiers: disk (the registered PEFT directory, as it was when registered) -> CPU (`max_cpu_loras` parsed
  LoraWeights, LRU) -> device (`max_loras` slots, LRU among slots no running request holds and nobody
  pinned). The scheduler acquires a slot per request (None: every slot busy, or the adapter still
  loading: wait) and releases it when the request leaves the batch.
- Buffers: exactly what kernels/lora_ops.py takes, per layer and fused module (r = the buffers' rank,
  `r_max`):

    qkv      A [max_loras, 3 * r, hidden]   B [max_loras, q_size + 2 * kv_size, r]
    o        A [max_loras, r, q_size]       B [max_loras, hidden, r]
    gate_up  A [max_loras, 2 * r, hidden]   B [max_loras, 2 * intermediate, r]
    down     A [max_loras, r, intermediate] B [max_loras, hidden, r]

  with scaling folded into B, lower ranks zero-padded, untargeted modules zero, and `ranks` [max_loras]
  int32 holding each slot's true rank (0 = empty) so kernels skip the padding. B is stored rank-major
  (lora_ops.stacked_b: storage [max_loras, r, out_total], handed out as its [max_loras, out_total, r]
  view): an adapter of rank 16 reads 16 whole rows of B whatever r is.
- Background loads (the engine's): `acquire` never reads the disk; an adapter in neither tier is read by
  a background thread (lora/prefetch.py; `prefetch` starts it when a request is admitted) while `acquire`
  answers None, and a failed read is raised by the next `acquire`. On CUDA the CPU tier also holds each
  adapter staged in the slots' layout and dtype in pinned memory, copied without blocking the host.
- Rank: the buffers' rank follows the largest adapter loaded so far (rounded up to RANK_STEP, at most
  max_lora_rank), so they take no more memory than the fleet needs. A larger rank grows them once: new
  buffers with every loaded slot copied over, swapped in as one (A, B) pair, so a step that already holds
  the old pair (or a kernel table made from it) finishes on it.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from loraplex.engine.api import AdapterStats
from loraplex.engine.kernels.cpu.build import WEIGHT_CODES
from loraplex.engine.kernels.cpu.copy_blocks import copy_blocks, copy_blocks_available, scale_bits_column
from loraplex.engine.kernels.lora_ops import LoraBatchIndex, apply_lora, bgmv_shrink_expand, stacked_b
from loraplex.engine.lora.peft import (
    FUSED,
    AdapterError,
    AdapterInUseError,
    AdapterNotFoundError,
    LoraWeights,
    fused_rows,
    module_dims,
)
from loraplex.engine.lora.prefetch import CpuTiers, Registration, StagedAdapter, copy_staged
from loraplex.engine.models.llama import LlamaConfig

# An adapter is folded into the fused decode step's GEMMs (kernels/cpu/lora_fold.c) when it holds at
# least this share of a step's tokens, and this many: then its shrink and expand run at the GEMM's rate
# (lora.c reaches about 40% of it) and the shrink rows computed for the other tokens cost less than
# the separate pass saves.
FOLD_MIN_SHARE = 0.5
FOLD_MIN_TOKENS = 8

# The buffers' rank is a multiple of this (or max_lora_rank): whole 8-float chunks for the CPU kernels.
RANK_STEP = 8

# Block tables kept for reuse (_slot_blocks): about 34 KB each for the default model.
TABLES_KEPT = 16

_ONE, _SCALED, _ZERO = 0, 1, 2  # a slot block's scale (_slot_blocks): 1, the adapter's scaling, zero fill


def slot_buffer_shapes(config: LlamaConfig, max_loras: int, max_lora_rank: int) -> dict[str, tuple[tuple, tuple]]:
    """Per fused module, the shapes of one layer's stacked A [slots, S * r, in] and B [slots, out_total, r]."""
    dims, r = module_dims(config), max_lora_rank
    shapes = {}
    for f, modules in FUSED.items():
        rows = fused_rows(config, f)
        shapes[f] = ((max_loras, len(rows) * r, dims[modules[0]][0]), (max_loras, sum(w for _, _, w in rows), r))
    return shapes


def slot_buffer_bytes(config: LlamaConfig, max_loras: int, max_lora_rank: int, dtype: torch.dtype) -> int:
    """Bytes of a LoraSlots' buffers (every layer's A and B, and the ranks): what a model's first adapter
    allocates on the device (the model pool counts them against its budget)."""
    shapes = slot_buffer_shapes(config, max_loras, max_lora_rank)
    per_layer = sum(math.prod(a) + math.prod(b) for a, b in shapes.values())
    return config.num_layers * per_layer * dtype.itemsize + max_loras * 4


@dataclass
class LoraSlotStats:
    loads: int = 0  # adapters written into a device slot
    evictions: int = 0  # loaded adapters pushed out of their slot for another
    cpu_hits: int = 0  # slot loads served by the CPU tier
    disk_loads: int = 0  # slot loads that re-read the adapter from disk
    last_load_ms: float = 0.0  # wall time of the latest slot load (read + copy)
    load_seconds: float = 0.0  # wall time of every slot load so far: over `loads`, the mean load time


class LoraSlots(CpuTiers):
    """Adapters of one base model, from registration to device slots. Thread-safe (one lock)."""

    def __init__(self, config: LlamaConfig, max_loras: int, max_lora_rank: int, max_cpu_loras: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", background: bool = False):
        for name, value, low in (("max_loras", max_loras, 1), ("max_lora_rank", max_lora_rank, 1),
                                 ("max_cpu_loras", max_cpu_loras, 0)):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        self.config = config
        self.max_loras, self.max_lora_rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        self.dtype, self.device = dtype, torch.device(device)
        self._rows = {f: fused_rows(config, f) for f in FUSED}  # fused -> [(module, row offset, width)]
        self._in = {f: a[2] for f, (a, _) in slot_buffer_shapes(config, 1, 1).items()}
        self.ranks = torch.zeros(max_loras, dtype=torch.int32, device=device)  # [slots], 0 = empty
        self.stats = LoraSlotStats()
        self._kernel_table = None  # kernel_table(), built on first use
        self._folds: dict[int, torch.Tensor] = {}  # slot -> its adapter packed for folding (fold_for)
        self.writes = [0] * max_loras  # slot -> times written: a copy made from a slot names the write it saw
        self._views: dict[int, list] = {}  # slot -> _slot_views(slot)
        self._view_addresses: dict[int, torch.Tensor] = {}
        # Per view (the same for every slot): its A rows' features, its width of B's rows and B's row stride
        # (the fused module's outputs) (_slot_blocks).
        self._view_dims = torch.tensor([(self._in[f], width, sum(w for _, _, w in rows))
                                        for _ in range(config.num_layers) for f, rows in self._rows.items()
                                        for _, _, width in rows], dtype=torch.int64)
        # Per slot, the rank below which its A rows / B rows may hold non-zero values (all else is zero).
        self._dirty = [0] * max_loras
        # (id of an adapter's offsets, its rank, the slot's dirty rank) -> (those offsets, the block table):
        # a table holds no address, so adapters of one header and shape (which share their offsets) reuse
        # one whatever the slot (_slot_blocks).
        self._tables: OrderedDict[tuple[int, int, int], tuple[object, torch.Tensor]] = OrderedDict()
        self._copy_in_c = self.device.type == "cpu" and dtype in WEIGHT_CODES and copy_blocks_available()
        self._lock = threading.RLock()
        self.r_max = 0  # the buffers' rank (_grow)
        self._buffers: tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]] = ([], [])
        self._grow(1)
        self._registered: dict[str, Registration] = {}
        self._registered_total = 0
        self._owner: list[str | None] = [None] * max_loras  # slot -> adapter
        self._loaded: OrderedDict[str, int] = OrderedDict()  # adapter -> slot, least recently used first
        self._refs: dict[str, int] = {}  # adapter -> acquisitions not yet released
        self._pinned: set[str] = set()
        self._init_tiers(background)

    # ----------------------------------------------------------------------------------- layout

    @property
    def lora_a(self) -> list[dict[str, torch.Tensor]]:
        """Per layer, fused module -> stacked A [slots, S * r_max, in]."""
        return self._buffers[0]

    @property
    def lora_b(self) -> list[dict[str, torch.Tensor]]:
        """Per layer, fused module -> stacked B [slots, out_total, r_max], rank-major (lora_ops.stacked_b)."""
        return self._buffers[1]

    def slice_widths(self, module: str) -> tuple[int, ...]:
        """Output widths of the slices of fused module (qkv: q, k, v; gate_up: gate, up; o, down: one)."""
        return tuple(w for _, _, w in self._rows[module])

    def buffers(self, layer: int, module: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(A [slots, S * r_max, in], B [slots, out_total, r_max] rank-major) of one layer's fused module."""
        a, b = self._buffers  # (one pair: a growth may swap them between two reads)
        return a[layer][module], b[layer][module]

    def apply(self, layer: int, module: str, x: torch.Tensor, out: torch.Tensor, index: LoraBatchIndex) -> None:
        """out += each token's adapter delta for this layer and module (what LlamaModel.forward wants per step)."""
        a, b = self.buffers(layer, module)
        apply_lora(x, out, a, b, index, slice_widths=self.slice_widths(module), ranks=self.ranks)

    def apply_static(self, layer: int, module: str, x: torch.Tensor, out: torch.Tensor,
                     token_slots: torch.Tensor) -> None:
        """apply() for a static decode step (engine/static_decode.py): BGMV over a device slot tensor [T]
        int32 (-1 = no adapter), with no host work that depends on the slots, so it can be captured."""
        a, b = self.buffers(layer, module)
        bgmv_shrink_expand(x, out, a, b, token_slots, slice_widths=self.slice_widths(module), ranks=self.ranks)

    def kernel_table(self):
        """The slot buffers as the fused CPU decode step takes them (kernels/cpu/decode_step.py), built
        once; None off the CPU, in other dtypes than fp32, bf16 and fp16, or without the C kernels."""
        table = self._kernel_table  # every decode step asks: no wait behind a registration holding the lock
        if table is not None:
            return table
        with self._lock:  # (not built from buffers a growth is swapping out)
            if self._kernel_table is None and self.device.type == "cpu":
                from loraplex.engine.kernels.cpu.decode_step import DecodeStepLora, decode_step_available

                if self.dtype in WEIGHT_CODES and decode_step_available():
                    a, b = self._buffers
                    self._kernel_table = DecodeStepLora(a, b, self.ranks, {f: self.slice_widths(f) for f in FUSED})
            return self._kernel_table

    def fold_for(self, index: LoraBatchIndex, table=None) -> tuple[int, torch.Tensor] | None:
        """(slot, packed block) of the step's adapter to fold into the fused decode step's GEMMs: the one
        with the most tokens, when it has FOLD_MIN_SHARE of them and FOLD_MIN_TOKENS; else None. The
        block is packed from `table` (the step's kernel table; default: the current one) on first use and
        kept until the slot is rewritten or the buffers grow."""
        counts: dict[int, int] = {}
        for start, end, slot in index.lora_segments:
            counts[slot] = counts.get(slot, 0) + end - start
        if not counts:
            return None
        slot, n = max(counts.items(), key=lambda kv: kv[1])
        table = table if table is not None else self.kernel_table()
        if table is None or n < FOLD_MIN_TOKENS or n < FOLD_MIN_SHARE * index.num_tokens:
            return None
        with self._lock:
            if table is not self._kernel_table:  # the buffers grew since the step took its table
                return slot, table.pack_fold(slot)
            fold = self._folds.get(slot)
            if fold is None:
                fold = self._folds[slot] = table.pack_fold(slot)
        return slot, fold

    def merged_weight(self, layer: int, module: str, slot: int, base: torch.Tensor, out: torch.Tensor) -> bool:
        """out [out_total, in] = base + the slot's delta for this layer and fused module (each slice's
        scaled B @ A), for lora/merged.py. Returns False, writing nothing, where the adapter leaves the
        module alone (its B is all zero)."""
        with self._lock:
            rank, r_max = int(self.ranks[slot]), self.r_max
            a, b = (t[slot] for t in self.buffers(layer, module))  # [S * r_max, in], [out_total, r_max] (scaled)
            if rank == 0 or not bool(b[:, :rank].any()):
                return False
            for s, (_, off, width) in enumerate(self._rows[module]):
                torch.addmm(base[off:off + width], b[off:off + width, :rank].to(base.dtype),
                            a[s * r_max:s * r_max + rank].to(base.dtype), out=out[off:off + width])
            return True

    def slot_stats(self) -> AdapterStats:
        """The engine stats' adapter record, as far as the slots know it (the core adds the requests' adapters)."""
        counted = self.stats
        return AdapterStats(loaded=len(self.loaded()), slots=self.max_loras, device=tuple(sorted(self.loaded())),
                            cpu=tuple(sorted(self.cpu_cached())), slot_bytes=self.nbytes(),
                            loads=counted.loads, disk_loads=counted.disk_loads, load_seconds=counted.load_seconds,
                            evictions=counted.evictions)

    def nbytes(self) -> int:
        """Device memory of the slot buffers (at their rank now) and the folded copies."""
        buffers = [t for layer in (*self.lora_a, *self.lora_b) for t in layer.values()]
        return sum(t.numel() * t.element_size() for t in (*buffers, *self._folds.values()))

    # --------------------------------------------------------------------------------- registry

    def register(self, adapter_id: str, path: str | Path, version: tuple | None = None) -> tuple:
        """Parses and validates the adapter now, so a bad one is refused here and nothing changes, and
        returns its files' version. The parsed weights stay private to the slots: their memory is recycled
        once they leave the CPU tier. With `version` (what registering these files returned before, as for
        a model the pool loads again), nothing is read now: the first load reads them, and refuses them
        unless they are still that version."""
        if not isinstance(adapter_id, str) or not adapter_id:
            raise AdapterError(f"adapter id must be a non-empty string, got {adapter_id!r}")
        with self._lock:
            if adapter_id in self._registered:
                raise AdapterError(f"adapter {adapter_id!r} is already registered; unregister it first")
            lora = None
            if version is None:
                lora = self._read(path)
                version = lora.version
            self._registered_total += 1
            self._registered[adapter_id] = Registration(str(path), self._registered_total, version)
            if lora is not None:
                self._remember(adapter_id, lora, self._stage(lora))
            return version

    def unregister(self, adapter_id: str) -> None:
        """Forgets the adapter and frees its slot; refused while requests hold it (AdapterInUseError)."""
        with self._lock:
            self._check_known(adapter_id)
            if self._refs.get(adapter_id, 0):
                raise AdapterInUseError(f"adapter {adapter_id!r} is in use by {self._refs[adapter_id]} running "
                                        "request(s); unregister it once they finish")
            slot = self._loaded.pop(adapter_id, None)
            if slot is not None:
                self._owner[slot] = None
                self._write_slot(slot, None)
            self._pinned.discard(adapter_id)
            self._refs.pop(adapter_id, None)
            self._forget(adapter_id)
            self._pending.pop(adapter_id, None)  # (a read in flight finds its registration gone: dropped)
            self._load_errors.pop(adapter_id, None)
            del self._registered[adapter_id]

    def registration(self, adapter_id: str) -> int:
        """Which registration of `adapter_id` this is: a number no other registration shares. The prefix
        cache keys KV blocks on it, so an id unregistered and registered again, over other weights, never
        hits the blocks its old weights computed."""
        return self._registered[adapter_id].number

    def __contains__(self, adapter_id: object) -> bool:
        return adapter_id in self._registered

    def adapter_ids(self) -> list[str]:
        return list(self._registered)

    def slot_of(self, adapter_id: str) -> int | None:
        """The device slot holding the adapter, or None when it is not loaded."""
        return self._loaded.get(adapter_id)

    def refcount(self, adapter_id: str) -> int:
        return self._refs.get(adapter_id, 0)

    def is_pinned(self, adapter_id: str) -> bool:
        return adapter_id in self._pinned

    def cpu_cached(self) -> list[str]:
        """Adapters in the CPU tier, least recently used first."""
        return list(self._cpu)

    def loaded(self) -> list[str]:
        """Adapters in device slots, least recently used first."""
        return list(self._loaded)

    # -------------------------------------------------------------------------------- residency

    def acquire(self, adapter_id: str) -> int | None:
        """A slot holding the adapter, loading it (evicting the LRU idle unpinned slot) if needed.

        Returns None when every slot is held or pinned, or (background loads) while the adapter is read
        from disk in the background (started here if no `prefetch` did): the caller waits and retries.
        Raises the AdapterError of a failed read. Each successful call must be paired with `release`.
        """
        with self._lock:
            self._check_known(adapter_id)
            if self.background and not self._resident(adapter_id) and adapter_id not in self._ready:
                error = self._load_errors.pop(adapter_id, None)
                if error is not None:
                    raise error
                self.prefetch(adapter_id)
                return None
            slot = self._ensure_loaded(adapter_id)
            if slot is not None:
                self._refs[adapter_id] = self._refs.get(adapter_id, 0) + 1
            return slot

    def release(self, adapter_id: str) -> None:
        with self._lock:
            if self._refs.get(adapter_id, 0) < 1:
                raise RuntimeError(f"release({adapter_id!r}) without a matching acquire")
            self._refs[adapter_id] -= 1

    def pin(self, adapter_id: str) -> int:
        """Loads the adapter and keeps it in its slot until `unpin` or `unregister`; returns the slot."""
        with self._lock:
            slot = self._ensure_loaded(adapter_id)
            if slot is None:
                raise AdapterInUseError(f"cannot pin adapter {adapter_id!r}: all {self.max_loras} device slots are "
                                        "in use or pinned")
            self._pinned.add(adapter_id)
            return slot

    def unpin(self, adapter_id: str) -> None:
        """Makes the adapter evictable again (it stays loaded until a slot is needed)."""
        with self._lock:
            self._check_known(adapter_id)
            self._pinned.discard(adapter_id)

    # --------------------------------------------------------------------------------- internals

    def _check_known(self, adapter_id: str) -> None:
        if adapter_id not in self._registered:
            raise AdapterNotFoundError(f"adapter {adapter_id!r} is not registered")

    def _ensure_loaded(self, adapter_id: str) -> int | None:
        self._check_known(adapter_id)
        slot = self._loaded.get(adapter_id)
        if slot is not None:
            self._loaded.move_to_end(adapter_id)
            return slot
        free = [s for s, owner in enumerate(self._owner) if owner is None]
        victim = None
        if not free:
            victim = next((a for a in self._loaded if not self._refs.get(a) and a not in self._pinned), None)
            if victim is None:
                return None
        start = time.perf_counter()
        lora, image = self._weights(adapter_id)  # before evicting: a failed disk read leaves the slots as they were
        if victim is not None:
            slot = self._loaded.pop(victim)
            self.stats.evictions += 1
        else:
            slot = free[0]
        self._write_slot(slot, lora, image)
        self._owner[slot] = adapter_id
        self._loaded[adapter_id] = slot
        self.stats.loads += 1
        took = time.perf_counter() - start
        self.stats.last_load_ms = took * 1000.0
        self.stats.load_seconds += took
        return slot

    def _grow(self, rank: int) -> None:
        """Makes the buffers' rank at least `rank` (rounded up to RANK_STEP, at most max_lora_rank): new
        zeroed buffers with every slot's rows copied in, swapped in as one pair. Tables, folds and slot
        views made from the old buffers are dropped; whoever still holds them reads the old pair."""
        new = min(-(-rank // RANK_STEP) * RANK_STEP, self.max_lora_rank)
        old = self.r_max
        if new <= old:
            return
        shapes, pair = slot_buffer_shapes(self.config, self.max_loras, new), ([], [])
        for layer in range(self.config.num_layers):
            a_new = {f: torch.zeros(a, dtype=self.dtype, device=self.device) for f, (a, _) in shapes.items()}
            b_new = {f: stacked_b(*b, dtype=self.dtype, device=self.device) for f, (_, b) in shapes.items()}
            if old:
                for f, rows in self._rows.items():
                    a_old, b_old = self.buffers(layer, f)  # [slots, S * old, in], [slots, out, old]
                    a_new[f].view(self.max_loras, len(rows), new, -1)[:, :, :old] = \
                        a_old.view(self.max_loras, len(rows), old, -1)
                    b_new[f][:, :, :old] = b_old
            pair[0].append(a_new)
            pair[1].append(b_new)
        self._buffers, self.r_max = pair, new
        self._kernel_table = None
        self._folds.clear()
        self._views.clear()
        self._view_addresses.clear()

    def _write_slot(self, slot: int, lora: LoraWeights | None, image: StagedAdapter | None = None) -> None:
        """Overwrites the whole slot: A and scaling * B in their rows, zeros everywhere else (None: all
        zeros, an empty slot); from `image` (lora's slot image) when given, without blocking the host."""
        rank = lora.rank if lora is not None else 0
        self._grow(rank)
        self._folds.pop(slot, None)
        self.writes[slot] += 1
        self.ranks[slot] = rank
        if image is not None:
            copy_staged(image, self._buffers, slot, self.r_max, self._dirty[slot], self._rows)
        else:
            self._run_blocks(slot, self._slot_blocks(slot, lora), lora)
        self._dirty[slot] = rank

    def _slot_blocks(self, slot: int, lora: LoraWeights | None) -> torch.Tensor:
        """The writes that put `lora` (None: nothing) in the slot, as int64 rows [blocks, 10]: (view, 0 for
        its A rows or 1 for its B rows (_slot_views), source offset in lora.values or -1 for zeros, first
        element in the view, rows, cols, source row and column strides, dst row stride, scale: _ONE,
        _SCALED or _ZERO). Per (layer, module): its A rows [rank, in] (dense source rows) and its scaled B
        rows [rank, width] (from PEFT's B [width, rank], read transposed), then zeros over what an earlier
        adapter left between the new rank (0 where untargeted) and the slot's dirty rank.
        Each element is written once at most, and a slot that only ever held adapters of one rank is never
        zeroed (the buffers start at zero). Built as columns: a load sits on a request's path, and one
        Python tuple per block cost more than the copies. The table names views by index and sources by
        offset, so it depends on the adapter's offsets, its rank and the slot's dirty rank alone: it is
        kept for the next adapter of that header and shape (they share their offsets; peft._layouts),
        which saves about 1 ms of a 3 ms slot write from the CPU tier."""
        offsets = lora.offsets if lora is not None else None
        key = (id(offsets), lora.rank if lora is not None else 0, self._dirty[slot])
        kept = self._tables.get(key)
        if kept is not None and kept[0] is offsets:  # (the offsets are held, so their id is not reused)
            self._tables.move_to_end(key)
            return kept[1]
        blocks = self._build_blocks(slot, lora)
        self._tables[key] = (offsets, blocks)
        while len(self._tables) > TABLES_KEPT:
            self._tables.popitem(last=False)
        return blocks

    def _build_blocks(self, slot: int, lora: LoraWeights | None) -> torch.Tensor:
        """_slot_blocks' table, built."""
        views, dims = self._slot_views(slot), self._view_dims  # dims [views, 3]: (in, width, B's row stride)
        n, in_f, width, b_ld = len(views), dims[:, 0], dims[:, 1], dims[:, 2]
        at = torch.full((n, 2), -1, dtype=torch.int64)  # per view: its A and B start in lora.values
        if lora is not None:
            at = torch.tensor([lora.offsets.get(key, (-1, -1)) for key, _, _ in views], dtype=torch.int64)
        if lora is not None and lora.module_ranks is not None:  # (rank_pattern: rows up to lora.rank stay zero)
            live = torch.tensor([lora.module_ranks.get(key, 0) for key, _, _ in views], dtype=torch.int64)
        else:  # per view: its rank
            live = torch.where(at[:, 0] >= 0, lora.rank if lora is not None else 0, 0)
        stale = (self._dirty[slot] - live).clamp(min=0)

        def rows(*columns) -> torch.Tensor:
            return torch.stack([torch.broadcast_to(torch.as_tensor(c, dtype=torch.int64), (n,)) for c in columns], 1)

        view = torch.arange(n)
        return torch.cat([rows(view, 0, at[:, 0], 0, live, in_f, in_f, 1, in_f, _ONE)[live > 0],
                          rows(view, 1, at[:, 1], 0, live, width, 1, live, b_ld, _SCALED)[live > 0],
                          rows(view, 0, -1, live * in_f, stale, in_f, 0, 1, in_f, _ZERO)[stale > 0],
                          rows(view, 1, -1, live * b_ld, stale, width, 0, 1, b_ld, _ZERO)[stale > 0]])

    def _run_blocks(self, slot: int, blocks: torch.Tensor, lora: LoraWeights | None) -> None:
        """One C call over all blocks for fp32, bf16 or fp16 slots on the CPU; torch ops per block elsewhere.
        `lora`: whose values the blocks' source offsets index (None when every block is a zero fill)."""
        view, ab, src, at, nrows, ncols, sld, scs, dld, scale = blocks.unbind(1)
        views = self._slot_views(slot)  # (and their addresses; a kept table did not ask for them)
        # each block's factor, float64: 1, the adapter's scaling (its module's, under alpha_pattern or
        # rank_pattern) or 0, by the block's code (_ONE, _SCALED, _ZERO)
        factor = torch.tensor((1.0, lora.scaling if lora is not None else 0.0, 0.0), dtype=torch.float64)[scale]
        if lora is not None and lora.module_scalings is not None:
            per_view = torch.tensor([lora.module_scalings.get(key, 0.0) for key, _, _ in views], dtype=torch.float64)
            factor = torch.where(scale == _SCALED, per_view[view], factor)
        if self._copy_in_c:  # C reads the source rows at their raw addresses
            base = lora.values.data_ptr() if lora is not None else 0
            copy_blocks(torch.stack([torch.where(src >= 0, base + 4 * src, 0),  # (the values are fp32)
                                     self._view_addresses[slot][view, ab] + self.dtype.itemsize * at,
                                     nrows, ncols, sld, dld, scale_bits_column(factor), scs], 1), self.dtype)
            return
        for (v, b, first, start, r, c, _, cs, ld, _), f in zip(blocks.tolist(), factor.tolist(), strict=True):
            dst = views[v][1 + b]
            out = dst.as_strided((r, c), (ld, 1), dst.storage_offset() + start)
            if first < 0:
                out.zero_()
                continue
            source = lora.values[first:first + r * c]  # dense rows [r, c], or (cs > 1) [c, r] read transposed
            source = source.view(r, c) if cs == 1 else source.view(c, r).t()
            out.copy_(source if f == 1.0 else source * f)  # scaled in fp32, rounded to the slots' dtype once

    def _slot_views(self, slot: int) -> list[tuple[tuple[int, str], torch.Tensor, torch.Tensor]]:
        """Per (layer, module) of a slot: its A rows [r_max, in] and B rows [r_max, width] (rank-major:
        rows out_total apart) in the stacked buffers, sliced once per slot (a load then only copies: it
        sits on a request's path), with their addresses (_view_addresses[slot], int64 [views, 2]) for the
        C copy."""
        views = self._views.get(slot)
        if views is None:
            r_max, views = self.r_max, []
            for layer in range(self.config.num_layers):
                for f, rows in self._rows.items():
                    # [S*r_max, in], [r_max, out] (B's storage)
                    a_buf, b_buf = self.lora_a[layer][f][slot], self.lora_b[layer][f][slot].t()
                    views += [((layer, m), a_buf[s * r_max:(s + 1) * r_max], b_buf[:, off:off + width])
                              for s, (m, off, width) in enumerate(rows)]
            self._views[slot] = views
            self._view_addresses[slot] = torch.tensor([(a.data_ptr(), b.data_ptr()) for _, a, b in views],
                                                      dtype=torch.int64)
        return views

