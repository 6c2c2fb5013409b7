"""Turns a scheduled batch into tensors, runs the model over the paged KV cache, samples.

- The batch is flat: every scheduled token of every request, in batch order, no padding; all-decode steps may
  instead run over static bucket-padded buffers (static_decode.py: CUDA graphs on CUDA), with the same result.
- The runner reads the requests and writes nothing onto them: `launch` lays the step out, runs it and starts the copy
  of its tokens to the host, returning a LaunchedStep whose `output()` is the step's StepOutput (sampled tokens, their
  log-probabilities, rejected drafts, prompt log-probabilities), which `Scheduler.update` and the core apply.
  `execute` is both at once.
- Asynchronous scheduling: a step may be launched while the previous one is still in flight. A request that step
  sampled then has a pending token (Request.num_pending), the input of its next row: the layout leaves a placeholder
  there and the launch fills it on the device from the previous step's sampled tokens, so no step waits for the host
  to see a token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from loraplex.engine.attention.base import is_decode
from loraplex.engine.host_copy import upload
from loraplex.engine.kernels.lora_ops import LoraBatchIndex
from loraplex.engine.kv.block_pool import allocate_kv_storage, layer_views
from loraplex.engine.kv.kv_dtype import raw
from loraplex.engine.lora.merged import MergedAdapter
from loraplex.engine.lora.slots import LoraSlots
from loraplex.engine.models.llama import LlamaModel
from loraplex.engine.sampler import DrawnTokens, draw, sample_steps, token_logprobs
from loraplex.engine.sched.scheduler import ScheduledBatch
from loraplex.engine.static_decode import StaticDecodeRunner, StaticDecodeSpec
from loraplex.engine.step_output import StepOutput


class StepLora:
    """The adapters of one step, as LlamaModel.forward calls them: lora.apply(layer, module, x, out)."""

    def __init__(self, slots: LoraSlots, index: LoraBatchIndex, merge: MergedAdapter | None = None):
        self.slots = slots
        self.index = index
        self.merge = merge

    def apply(self, layer: int, module: str, x: torch.Tensor, out: torch.Tensor) -> None:
        self.slots.apply(layer, module, x, out, self.index)

    def kernel_args(self):
        """For the fused CPU decode step: (the slots' kernel table, this step's tokens grouped by slot,
        the adapter to fold or None, None), or (None, None, None, merged layers) when every token runs on
        one merged adapter (lora/merged.py); None where the slots have no kernel table."""
        table = self.slots.kernel_table()
        if table is None:
            return None
        merged = self.merge.layers_for(self.index) if self.merge is not None else None
        if merged is not None:
            return None, None, None, merged
        return table, self.index.slot_groups, self.slots.fold_for(self.index, table), None


@dataclass
class StepLayout:
    """One step's flat rows, as both paths take them: every scheduled token in batch order."""

    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    seqs: list[tuple[int, int, list[int]]] = field(default_factory=list)  # (computed, new, blocks)
    logits_rows: list[int] = field(default_factory=list)  # each sampled request's last row and its drafts'
    sampled: list = field(default_factory=list)
    token_slots: list[int] = field(default_factory=list)  # LoRA slot per row, -1 = base model
    prompt_rows: list[int] = field(default_factory=list)  # rows whose logits predict a prompt token
    prompt_targets: list[tuple] = field(default_factory=list)  # (request, the prompt token those logits predict)
    output_positions: list[int] = field(default_factory=list)  # each sampled request's next output index
    # rows whose token the previous step sampled (still in flight), and that token's index in its tokens
    pending_rows: list[int] = field(default_factory=list)
    pending_from: list[int] = field(default_factory=list)


class LaunchedStep:
    """A step the runner launched: its sampled tokens on the device (`tokens`, [sampled] int64, the inputs
    of the next step's pending rows) and `output()`, which waits for their copy to the host."""

    def __init__(self, sampled: list, drawn: DrawnTokens | None, eager: StepOutput):
        self.rows = {id(r): i for i, r in enumerate(sampled)} if drawn is not None else {}  # request -> row
        self.tokens = drawn.tokens if drawn is not None else None
        self._drawn = drawn
        self._out = eager  # prompt log-probabilities (and drafts' results), known at launch

    def output(self) -> StepOutput:
        if self._drawn is not None:
            tokens, logprobs = self._drawn.result()
            self._out.tokens, self._out.logprobs = [[t] for t in tokens], [[lp] for lp in logprobs]
            self._out.num_rejected = [0] * len(tokens)
            self._drawn = None
        return self._out


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, num_swap_blocks: int = 0,
                 static_decode: StaticDecodeSpec | None = None, kv_dtype: torch.dtype | None = None):
        """static_decode: run all-decode steps over static buffers (one more KV block, never handed out by the
        block pool, takes the padded rows' K/V); None: every step dynamic. kv_dtype: the KV cache's element
        type (kv/kv_dtype.py; None: the model's dtype)."""
        cfg = model.config
        self.model = model
        self.device = model.device
        self.block_size = block_size
        self.lora_slots: LoraSlots | None = None
        self.lora_merge: MergedAdapter | None = None  # set with lora_slots where merging is on
        self._last_lora_index: tuple[tuple[int, ...], LoraBatchIndex] | None = None  # (token slots, index)
        shape = (cfg.num_layers, block_size, cfg.num_kv_heads, cfg.head_dim)
        kv_dtype = kv_dtype or model.dtype
        # [layers, 2, blocks, block_size, kv_heads, row width]: one op moves a block (8-bit: and its scales) in
        # every layer
        extra = 1 if static_decode is not None else 0  # block num_blocks: the static step's scratch block
        self.kv_storage = allocate_kv_storage(shape[0], num_blocks + extra, *shape[1:], kv_dtype, model.device)
        self.kv_caches = layer_views(self.kv_storage)
        self.static: StaticDecodeRunner | None = None
        if static_decode is not None:
            self.static = StaticDecodeRunner(model, self.kv_caches, block_size, num_blocks, static_decode.max_rows,
                                             static_decode.max_model_len, graphs=static_decode.mode == "graphs")
            if self.static.graphs:
                self.static.capture()  # every bucket's base-model graph, now that the KV cache exists
        self.swap_storage = None
        if num_swap_blocks:
            self.swap_storage = allocate_kv_storage(shape[0], num_swap_blocks, *shape[1:], kv_dtype,
                                                    torch.device("cpu"))
            if self.device.type == "cuda":
                self.swap_storage = self.swap_storage.pin_memory()

    def _swap(self, batch: ScheduledBatch) -> None:
        """Copies preempted requests' KV out to the CPU swap space, and resumed ones' back in."""
        kv, swap = raw(self.kv_storage), raw(self.swap_storage)  # (bytes for 8-bit caches: fp8 has no index_put)
        for device_ids, cpu_ids in batch.swap_out:
            src = torch.tensor(device_ids, device=self.device)
            swap[:, :, torch.tensor(cpu_ids)] = kv[:, :, src].to("cpu")
        for cpu_ids, device_ids in batch.swap_in:
            dst = torch.tensor(device_ids, device=self.device)
            kv[:, :, dst] = swap[:, :, torch.tensor(cpu_ids)].to(self.device)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepOutput:
        """`launch` with nothing in flight, then its output."""
        return self.launch(batch).output()

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, previous: LaunchedStep | None = None) -> LaunchedStep:
        """Computes the batch's tokens; its output() is the new tokens of each `batch.sampled()` request
        (one, or with drafts the ones the model agreed with and its own next), their log-probabilities
        where it asked for them, its rejected drafts, and the prompt log-probabilities this step computed.
        `previous`: the step still in flight, whose sampled tokens are this step's pending inputs."""
        if batch.swap_out or batch.swap_in:
            self._swap(batch)
        lay = self._layout(batch, previous)
        dev = self.device
        if self._static_eligible(lay):
            lora = self.lora_slots if self.lora_slots is not None and max(lay.token_slots) >= 0 else None
            pending = (lay.pending_rows, lay.pending_from, previous.tokens) if lay.pending_rows else None
            logits = self.static.run(lay.ids, lay.positions, lay.seqs, lay.token_slots, lay.logits_rows, lora,
                                     pending=pending)
        else:
            meta = self.model.attention.build_metadata(lay.seqs, self.block_size, dev, self.model.dtype)
            ids, positions, rows, pending_rows, pending_from = upload(
                dev, torch.long, lay.ids, lay.positions, lay.logits_rows + lay.prompt_rows, lay.pending_rows,
                lay.pending_from)
            if lay.pending_rows:
                ids[pending_rows] = previous.tokens[pending_from]
            logits = self.model.forward(ids, positions, meta, self.kv_caches, rows,
                                        lora=self._step_lora(lay.token_slots))  # [sampled + prompt rows, vocab]
        out = StepOutput()
        if lay.prompt_rows:
            found = token_logprobs(logits[len(lay.logits_rows):], [t for _, t in lay.prompt_targets],
                                   [r.sampling.prompt_logprobs for r, _ in lay.prompt_targets])
            out.prompt_logprobs = [(req, step) for (req, _), step in zip(lay.prompt_targets, found, strict=True)]
            logits = logits[:len(lay.logits_rows)]
        if not lay.sampled:
            return LaunchedStep([], None, out)
        if any(r.spec_ids for r in lay.sampled):  # verifying drafts reads the host: not deferred
            out.tokens, out.logprobs, out.num_rejected = sample_steps(logits, lay.sampled)
            return LaunchedStep(lay.sampled, None, out)
        return LaunchedStep(lay.sampled, draw(logits, lay.sampled, lay.output_positions), out)

    @staticmethod
    def _layout(batch: ScheduledBatch, previous: LaunchedStep | None = None) -> StepLayout:
        """The step's rows: tokens, positions, sequences, logits rows, adapters, prompt log-probability rows;
        a pending token (sampled by `previous`, still in flight) as a placeholder to fill on the device."""
        lay = StepLayout()
        ids = lay.ids
        for req, n in batch.entries:
            lay.token_slots.extend([req.lora_slot] * n)
            start = req.num_computed
            if req.needs_prompt_logits:  # position p's logits predict prompt token p + 1; each is recorded once
                for p in range(max(start, len(req.prompt_logprobs)), min(start + n, len(req.prompt_ids) - 1)):
                    lay.prompt_rows.append(len(ids) + p - start)
                    lay.prompt_targets.append((req, req.prompt_ids[p + 1]))
            end = start + n - len(req.spec_ids)
            ids.extend(req.token_ids(start, min(end, req.num_known)))
            if end > req.num_known:  # its last token is still on the device
                if previous is None or end - req.num_known != 1 or id(req) not in previous.rows:
                    raise RuntimeError(f"request {req.request_id} has {req.num_pending} tokens in flight, "
                                       f"not one from the step before")
                lay.pending_rows.append(len(ids))
                lay.pending_from.append(previous.rows[id(req)])
                ids.append(0)
            ids.extend(req.spec_ids)
            lay.positions.extend(range(start, start + n))
            lay.seqs.append((start, n, req.blocks))
            if start + n >= req.num_tokens:  # the last token's logits, and each draft's
                lay.logits_rows.extend(range(len(ids) - 1 - len(req.spec_ids), len(ids)))
                lay.sampled.append(req)
                lay.output_positions.append(req.next_output_index)
        return lay

    def _static_eligible(self, lay: StepLayout) -> bool:
        """Static decode takes steps whose every row is a decode row (drafts included), with no prompt
        log-probabilities, within the largest bucket."""
        return (self.static is not None and not lay.prompt_rows and len(lay.ids) <= self.static.max_rows
                and all(is_decode(computed, new) for computed, new, _ in lay.seqs))

    def _step_lora(self, token_slots: list[int]) -> StepLora | None:
        if self.lora_slots is None or max(token_slots) < 0:
            return None
        return StepLora(self.lora_slots, self._lora_index(token_slots), self.lora_merge)

    def _lora_index(self, token_slots: list[int]) -> LoraBatchIndex:
        """The step's batch index, reused while the batch's slots stay the same: decode steps repeat the
        previous step's slots until a request joins, leaves or moves slot, and building the index and its
        slot groups costs 0.15-0.25 ms of Python per step on Zen 3. The index holds slot numbers only, so
        a slot rewritten in between is still described correctly."""
        key = tuple(token_slots)
        if self._last_lora_index is None or self._last_lora_index[0] != key:
            self._last_lora_index = (key, LoraBatchIndex.from_token_slots(token_slots, self.device))
        return self._last_lora_index[1]
