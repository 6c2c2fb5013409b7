"""Graph-safe decode steps: all-decode batches over preallocated device buffers, padded to bucketed row counts.

Why: an eager decode step is bound by the host (one launch per op, ~1,000+ per step). Here every index a step
needs lives in fixed device buffers, so the step's launches never change between steps of one bucket: on CUDA
each bucket is captured once as a CUDA graph and replayed; on the CPU the very same body runs eagerly (that is
how the tests hold it token-identical to the dynamic path).

- The host writes all of a step's ints into ONE staging buffer (pinned on CUDA) and does ONE host-to-device copy;
  nothing inside the step reads the device from the host.
- Rows are padded up to the bucket: padded rows write their K/V to a scratch block the block pool never hands
  out, attend a context of length 1 there, carry LoRA slot -1, and their logits are dropped.
- Decode attention runs with a fixed split count per bucket (from max_model_len) and preallocated split scratch.
- LoRA goes through BGMV over the static per-token slot tensor (LoraSlots.apply_static); sampling stays outside.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from loraplex.engine.attention.base import slots_of, write_kv
from loraplex.engine.kernels.paged_attention import NOMINAL_SMS, choose_num_splits, paged_decode_attention
from loraplex.engine.models.llama import LlamaModel

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
STATIC_BACKEND = "triton_paged"  # the only backend whose decode kernels the static step launches
# int32 regions of the staging / device buffers, each [max bucket] long, in this order; the first four are
# also needed as int64 (torch indexing) and are widened on the device by one copy inside the step.
_LONG_REGIONS = ("ids", "positions", "slots", "logits")
_INT_REGIONS = ("lens", "row_table", "lora", "pending_rows", "pending_from")  # (the last two: asynchronous scheduling)


def static_decode_mode(setting: str, device: torch.device, backend: str) -> str | None:
    """How static decode runs for EngineConfig.cuda_graphs `setting`: "graphs" (CUDA, auto or on), "eager" (the
    CPU, on only), or None (off, or a backend other than triton_paged)."""
    if setting == "off" or backend != STATIC_BACKEND:
        return None
    if device.type == "cuda":
        return "graphs"
    return "eager" if setting == "on" else None


def buckets_for(max_rows: int) -> tuple[int, ...]:
    """The buckets a runner serving at most `max_rows` decode rows needs (up to the first >= it, at most 256)."""
    top = next((b for b in BUCKETS if b >= max_rows), BUCKETS[-1])
    return tuple(b for b in BUCKETS if b <= top)


@dataclass(frozen=True)
class StaticDecodeSpec:
    """What a ModelRunner needs to set up static decode: mode ("graphs" or "eager", static_decode_mode), the most
    decode rows of a step (max_num_seqs x (1 + speculative tokens)) and the context length (block-table width,
    split count)."""

    mode: str
    max_rows: int
    max_model_len: int


@dataclass
class StaticDecodeMetadata:
    """One bucket's attention description, every tensor a fixed view of the static buffers."""

    slot_mapping: torch.Tensor  # [B] int64 flat cache slot each row writes its K/V to
    block_tables: torch.Tensor  # [max bucket + 1, max blocks per sequence] int32; row 0 = the scratch block
    rows: torch.Tensor  # [B] int32 0 .. B-1 (every row is a decode row)
    lens: torch.Tensor  # [B] int32 context each row attends, itself included (1 for padded rows)
    row_table: torch.Tensor  # [B] int32 block-table row of each row
    num_splits: int  # split-KV count, fixed per bucket
    scratch: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # split scratch when num_splits > 1
    max_len: int  # (unused with a fixed num_splits; kept for the backend interface)
    decode_all: bool = True


class StaticDecodeAttention:
    """Decode-only paged attention over StaticDecodeMetadata: the triton_paged decode kernel with a fixed split
    count and scratch, so its launches are the same every step of a bucket."""

    name = "triton_paged_static"
    fused_decode_step = False

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: StaticDecodeMetadata) -> torch.Tensor:
        """q [B, heads, head_dim]; k, v [B, kv_heads, head_dim]; caches [blocks, block_size, kv_heads, head_dim].
        Returns [B, heads * head_dim]."""
        n_tok, n_heads, head_dim = q.shape
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = q.new_empty(n_tok, n_heads, head_dim)  # every row is written by the decode kernel
        paged_decode_attention(q, k_cache, v_cache, out, meta.rows, meta.lens, meta.row_table, meta.block_tables,
                               1.0 / math.sqrt(head_dim), meta.max_len, num_splits=meta.num_splits,
                               scratch=meta.scratch)
        return out.view(n_tok, n_heads * head_dim)


class StaticLora:
    """The adapters of a static step, as LlamaModel.forward calls them, over the static per-token slots."""

    def __init__(self, slots, token_slots: torch.Tensor):
        self.slots = slots
        self.token_slots = token_slots  # [B] int32 view of the static buffer, -1 = base model / padded row

    def apply(self, layer: int, module: str, x: torch.Tensor, out: torch.Tensor) -> None:
        self.slots.apply_static(layer, module, x, out, self.token_slots)

    def kernel_args(self):
        return None  # (the fused CPU decode step never runs the static step: its backend is not fused)


class StaticDecodeRunner:
    """Runs all-decode steps of up to max(buckets) rows over static buffers; `steps` counts the steps it ran
    (`bucket_steps` per bucket).

    run(): fills the staging buffer, one copy, then the bucket's body — replayed as a CUDA graph when `graphs`
    (captured at `capture()` for the base model, at first use for each LoRA slot-buffer generation), else eager.
    """

    def __init__(self, model: LlamaModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 scratch_block: int, max_rows: int, max_model_len: int, graphs: bool):
        cfg = model.config
        self.model = model
        self.attention = StaticDecodeAttention()
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.scratch_slot = scratch_block * block_size  # padded rows write here and attend it
        self.buckets = buckets_for(max_rows)
        self.graphs = graphs
        self.steps = 0
        self.bucket_steps = dict.fromkeys(self.buckets, 0)  # steps run per bucket
        dev = model.device
        r = self.max_rows = self.buckets[-1]
        self.width = -(-max_model_len // block_size)  # block-table columns: a sequence's most blocks
        n_regions = len(_LONG_REGIONS) + len(_INT_REGIONS)
        self._tables_at = n_regions * r
        size = self._tables_at + (r + 1) * self.width
        self.staging = torch.zeros(size, dtype=torch.int32)  # [size] the host side of the one copy
        if dev.type == "cuda":
            self.staging = self.staging.pin_memory()
        self._np = self.staging.numpy()
        self._pad(0, r)
        self._np[self._tables_at] = scratch_block  # table row 0: the scratch block (padded rows' context)
        self.device_ints = self.staging.to(dev, copy=True)  # [size] int32, the static buffers
        self.device_longs = torch.zeros(len(_LONG_REGIONS), r, dtype=torch.long, device=dev)  # [4, R] widened
        self._copied = torch.cuda.Event() if dev.type == "cuda" else None  # staging free to refill
        self.logits = torch.zeros(r, cfg.vocab_size, dtype=torch.float32, device=dev)  # [R, vocab] static output
        tables = self.device_ints[self._tables_at:].view(r + 1, self.width)
        sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else NOMINAL_SMS
        self._meta: dict[int, StaticDecodeMetadata] = {}
        for b in self.buckets:
            splits = choose_num_splits(b, cfg.num_kv_heads, max_model_len, sms)
            scratch = None
            if splits > 1:
                part = torch.empty(b, cfg.num_heads, splits, dtype=torch.float32, device=dev)
                scratch = (part, torch.empty_like(part),
                           torch.empty(b, cfg.num_heads, splits, cfg.head_dim, dtype=torch.float32, device=dev))
            self._meta[b] = StaticDecodeMetadata(
                slot_mapping=self.device_longs[2, :b], block_tables=tables,
                rows=torch.arange(b, dtype=torch.int32, device=dev), lens=self._region("lens", b),
                row_table=self._region("row_table", b), num_splits=splits, scratch=scratch, max_len=max_model_len)
        self._pool = torch.cuda.graph_pool_handle() if graphs else None
        self._graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, object]] = {}  # (B, lora) -> (graph, key)

    # ------------------------------------------------------------------------------------- buffers

    def _offset(self, region: str) -> int:
        return (_LONG_REGIONS + _INT_REGIONS).index(region) * self.max_rows

    def _region(self, region: str, b: int) -> torch.Tensor:
        at = self._offset(region)
        return self.device_ints[at:at + b]

    def _pad(self, lo: int, hi: int) -> None:
        """Staging rows lo..hi-1 as padded rows: token 0 at position 0 into the scratch slot, context 1 on table
        row 0, no adapter, logits row 0 (dropped)."""
        for region, value in (("ids", 0), ("positions", 0), ("slots", self.scratch_slot), ("logits", 0),
                              ("lens", 1), ("row_table", 0), ("lora", -1)):
            at = self._offset(region)
            self._np[at + lo:at + hi] = value

    def bucket_for(self, rows: int) -> int | None:
        return next((b for b in self.buckets if b >= rows), None)

    def _stage(self, ids: list[int], positions: list[int], seqs: list[tuple[int, int, list[int]]],
               token_slots: list[int], logits_rows: list[int], bucket: int, pending_rows: list[int],
               pending_from: list[int]) -> None:
        """Writes the step into the staging buffer and copies it to the device in one copy."""
        if self._copied is not None:
            self._copied.synchronize()  # (the previous step's copy has long finished: its tokens were read)
        n, w, npv = len(ids), self.width, self._np
        lens: list[int] = []
        row_table: list[int] = []
        slots: list[int] = []
        tables_at = self._tables_at + w  # row 0 is the scratch block's
        for s, (computed, new, blocks) in enumerate(seqs):
            lens.extend(range(computed + 1, computed + new + 1))
            row_table.extend([s + 1] * new)
            slots.extend(slots_of(computed, new, blocks, self.block_size))
            used = blocks[:-(-(computed + new) // self.block_size)]  # (columns past lens are never read)
            npv[tables_at + s * w:tables_at + s * w + len(used)] = used
        for region, values in (("ids", ids), ("positions", positions), ("slots", slots), ("lens", lens),
                               ("row_table", row_table), ("lora", token_slots),
                               ("pending_rows", pending_rows), ("pending_from", pending_from)):
            at = self._offset(region)
            npv[at:at + len(values)] = values
        at = self._offset("logits")
        npv[at:at + len(logits_rows)] = logits_rows
        npv[at + len(logits_rows):at + bucket] = 0
        self._pad(n, bucket)
        end = self._tables_at + (len(seqs) + 1) * w
        self.device_ints[:end].copy_(self.staging[:end], non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    # ---------------------------------------------------------------------------------------- step

    def _body(self, bucket: int, lora_slots) -> None:
        """The captured part: widen the indices, run the model, keep the logits in the static output."""
        r = self.max_rows
        longs = self.device_longs[:, :bucket]
        longs.copy_(self.device_ints[:len(_LONG_REGIONS) * r].view(len(_LONG_REGIONS), r)[:, :bucket])
        lora = StaticLora(lora_slots, self._region("lora", bucket)) if lora_slots is not None else None
        logits = self.model.forward(longs[0], longs[1], self._meta[bucket], self.kv_caches, longs[3], lora=lora,
                                    attention=self.attention)
        self.logits[:bucket].copy_(logits)  # [B, vocab]

    def run(self, ids: list[int], positions: list[int], seqs: list[tuple[int, int, list[int]]],
            token_slots: list[int], logits_rows: list[int], lora_slots,
            pending: tuple[list[int], list[int], torch.Tensor] | None = None) -> torch.Tensor:
        """One all-decode step (rows <= max bucket); returns the logits of `logits_rows` [len, vocab] fp32, a view
        of the static output valid until the next step. lora_slots: the LoraSlots when a row has an adapter.
        pending: (rows, indices, tokens [n] on the device): rows whose token is tokens[index], written over their
        placeholders after the copy (the previous step's tokens, still in flight: asynchronous scheduling); the
        indices travel in the same copy."""
        bucket = self.bucket_for(len(ids))
        rows, index, tokens = pending if pending is not None else ([], [], None)
        self._stage(ids, positions, seqs, token_slots, logits_rows, bucket, rows, index)
        if rows:
            at_rows, at_index = (self._region(r, len(rows)).long() for r in ("pending_rows", "pending_from"))
            self._region("ids", bucket)[at_rows] = tokens[at_index].to(torch.int32)
        if self.graphs:
            self._replay(bucket, lora_slots)
        else:
            self._body(bucket, lora_slots)
        self.steps += 1
        self.bucket_steps[bucket] += 1
        return self.logits[:len(logits_rows)]

    # -------------------------------------------------------------------------------------- graphs

    @torch.inference_mode()
    def capture(self) -> None:
        """CUDA: captures every bucket's base-model graph (padded rows only in the buffers: each warm-up writes
        the scratch block alone), largest first: the smaller ones reuse its memory in the shared graph pool."""
        for b in reversed(self.buckets):
            self._body(b, None)  # warm-up: compiles the Triton kernels, initialises cuBLAS, off the capture
            self._capture(b, None)
        torch.cuda.synchronize(self.logits.device)

    def _capture(self, bucket: int, lora_slots) -> None:
        graph = torch.cuda.CUDAGraph()
        # thread_local: the adapter loader's side-stream copies on another thread may go on during a capture
        with torch.cuda.device(self.logits.device), \
                torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            self._body(bucket, lora_slots)
        self._graphs[(bucket, lora_slots is not None)] = (graph, _lora_key(lora_slots))

    def _replay(self, bucket: int, lora_slots) -> None:
        """Replays the bucket's graph; a LoRA graph is captured on first use and again after the slot buffers
        were reallocated (a larger rank): that step runs eagerly, then captures (a capture executes nothing)."""
        entry = self._graphs.get((bucket, lora_slots is not None))
        if entry is not None and _same_objects(entry[1], _lora_key(lora_slots)):
            with torch.cuda.device(self.logits.device):
                entry[0].replay()
            return
        self._body(bucket, lora_slots)
        self._capture(bucket, lora_slots)


def _lora_key(lora_slots) -> tuple | None:
    """What a LoRA graph captured: the slot buffers' objects (a growth swaps in new ones, whose addresses differ).
    Held with the graph, it also keeps the buffers it reads alive until it is recaptured."""
    if lora_slots is None:
        return None
    return (lora_slots, lora_slots.lora_a, lora_slots.lora_b, lora_slots.ranks)


def _same_objects(a: tuple | None, b: tuple | None) -> bool:
    return a is b or (a is not None and b is not None and all(x is y for x, y in zip(a, b, strict=True)))
