"""The fused decode step (kernels/cpu/decode_step.c) against the per-op path it replaces.

Both run the same C kernels in the same order, so logits and the KV cache must be bit-identical,
with and without adapters, on fp32 slot buffers and on 16-bit ones (EngineConfig.lora_dtype); a step
with a bad index must write nothing.
"""

from __future__ import annotations

import pytest
import torch

from loraplex.engine.attention.torch_sdpa import build_metadata
from loraplex.engine.kernels.cpu import linear
from loraplex.engine.kernels.lora_ops import LoraBatchIndex
from loraplex.engine.kv.block_pool import allocate_kv_storage, layer_views
from loraplex.engine.lora.slots import LoraSlots
from loraplex.engine.models.layer_ops import CpuKernelOps
from loraplex.engine.models.llama import LlamaModel
from loraplex.engine.models.loader import quantized_weights
from loraplex.engine.models.synthetic import synthetic_model
from loraplex.engine.runner import StepLora
from tests.kernels.test_cpu_quant_weights import K_QUANTS, random_kquant_weights
from tests.lora_factory import make_peft_dir

BLOCK, BLOCKS_PER_SEQ = 16, 4
SLOT_DTYPES = pytest.mark.parametrize("slot_dtype", [torch.float32, torch.bfloat16, torch.float16],
                                      ids=["f32", "bf16", "f16"])
PROMPTS = (5, 20, 33)  # context lengths before the decode: inside a block, past one, past two


def _model_and_cache(preset: str, seqs: int = len(PROMPTS), packed_dtype: torch.dtype = torch.float32,
                     blocks: str | None = None):
    """The synthetic model (with bf16 `packed_dtype`, its weights rounded to bf16 as load_model rounds
    them, and its projections packed in bf16; with `blocks`, its projections quantized to that GGUF block
    format as load_model quantizes them, or random blocks of a K-quant) and a KV cache for `seqs` sequences."""
    config, weights, _ = synthetic_model(preset)
    if packed_dtype != torch.float32:
        weights = {k: v.to(packed_dtype).float() for k, v in weights.items()}
    if blocks in K_QUANTS:  # (no quantizer makes these: random blocks)
        weights = random_kquant_weights(weights, blocks)
    elif blocks is not None:
        weights = quantized_weights(weights, blocks)
    model = LlamaModel(config, weights, packed_dtype)
    assert isinstance(model.ops, CpuKernelOps)
    storage = allocate_kv_storage(config.num_layers, 1 + seqs * BLOCKS_PER_SEQ, BLOCK, config.num_kv_heads,
                                  config.head_dim, torch.float32, torch.device("cpu"))
    return model, storage


def _blocks(i: int) -> list[int]:
    return list(range(1 + i * BLOCKS_PER_SEQ, 1 + (i + 1) * BLOCKS_PER_SEQ))  # block 0 stays unused


def _prefill(model, storage, g, prompts=PROMPTS) -> None:
    """Each prompt through the per-op path (prefills never take the fused step)."""
    for i, n in enumerate(prompts):
        ids = torch.randint(0, model.config.vocab_size, (n,), generator=g)
        meta = build_metadata([(0, n, _blocks(i))], BLOCK, torch.device("cpu"))
        model.forward(ids, torch.arange(n), meta, layer_views(storage), torch.tensor([n - 1]))


def _decode(model, storage, ids, logits_rows, lora=None, fused=True, monkeypatch=None, prompts=PROMPTS):
    meta = build_metadata([(n, 1, _blocks(i)) for i, n in enumerate(prompts)], BLOCK, torch.device("cpu"))
    assert meta.decode_all
    args = (ids, torch.tensor(prompts), meta, layer_views(storage), logits_rows)
    if fused:
        logits = model.ops.decode_step(model, *args, lora)
        assert logits is not None  # the fused path took the step
        return logits
    with monkeypatch.context() as m:
        m.setattr(model.ops, "decode_step", None)
        return model.forward(*args, lora=lora)


def _both_paths(model, storage, ids, logits_rows, monkeypatch, lora=None, prompts=PROMPTS):
    """One decode step through each path from the same cache; the cache is left as it was."""
    before = storage.clone()
    fused = _decode(model, storage, ids, logits_rows, lora, True, monkeypatch, prompts)
    after_fused = storage.clone()
    storage.copy_(before)
    per_op = _decode(model, storage, ids, logits_rows, lora, False, monkeypatch, prompts)
    assert torch.equal(fused, per_op)
    assert torch.equal(after_fused, storage)
    assert not torch.equal(before, storage)  # the step's K/V were written
    storage.copy_(before)
    return fused


@pytest.mark.parametrize("preset", ["tiny", "tiny-bias"])
def test_fused_decode_step_is_bit_identical_to_the_per_op_path(preset, monkeypatch):
    g = torch.Generator().manual_seed(0)
    model, storage = _model_and_cache(preset)
    _prefill(model, storage, g)
    ids = torch.randint(0, model.config.vocab_size, (len(PROMPTS),), generator=g)
    logits = _both_paths(model, storage, ids, torch.arange(len(PROMPTS)), monkeypatch)
    assert logits.shape == (len(PROMPTS), model.config.vocab_size) and torch.isfinite(logits).all()
    subset = _both_paths(model, storage, ids, torch.tensor([2, 0]), monkeypatch)  # sampled rows only, reordered
    torch.testing.assert_close(subset, logits[[2, 0]])


@SLOT_DTYPES
def test_fused_decode_step_adds_each_tokens_adapter(tmp_path, monkeypatch, slot_dtype):
    g = torch.Generator().manual_seed(1)
    model, storage = _model_and_cache("tiny")
    slots = LoraSlots(model.config, max_loras=3, max_lora_rank=8, max_cpu_loras=3, dtype=slot_dtype)
    for name, rank, targets in (("a", 8, "all"), ("b", 4, ("q", "v", "down"))):
        slots.register(name, make_peft_dir(tmp_path / name, model.config, rank, 16, targets, seed=rank))
    token_slots = [slots.acquire("b"), -1, slots.acquire("a")]  # two adapters of different rank beside the base
    _prefill(model, storage, g)
    ids = torch.randint(0, model.config.vocab_size, (len(PROMPTS),), generator=g)
    rows = torch.arange(len(PROMPTS))
    lora = StepLora(slots, LoraBatchIndex.from_token_slots(token_slots, torch.device("cpu")))
    assert lora.kernel_args() is not None
    assert slots.lora_a[0]["qkv"].dtype == slot_dtype
    with_lora = _both_paths(model, storage, ids, rows, monkeypatch, lora)
    base = _both_paths(model, storage, ids, rows, monkeypatch)
    assert torch.equal(with_lora[1], base[1])  # the base token is untouched
    assert not torch.allclose(with_lora[0], base[0]) and not torch.allclose(with_lora[2], base[2])


def test_side_prefetch_of_a_wide_batch_leaves_the_adapter_deltas_as_they_are(tmp_path, monkeypatch):
    """At 8+ rows each GEMM asks for its LoRA call's A and B rows (decode_step.c, SIDE_MIN_ROWS): whole
    slot blocks for the full-rank adapter, B's first 4 of 8 columns row by row for the other. A hint:
    the step stays bit-identical to the per-op path, which asks for nothing."""
    g = torch.Generator().manual_seed(4)
    prompts = (5, 20, 33, 7, 16, 17, 2, 40, 9, 31)
    model, storage = _model_and_cache("tiny", len(prompts))
    slots = LoraSlots(model.config, max_loras=3, max_lora_rank=8, max_cpu_loras=3)
    for name, rank, targets in (("a", 8, "all"), ("b", 4, ("q", "v", "gate", "down"))):
        slots.register(name, make_peft_dir(tmp_path / name, model.config, rank, 16, targets, seed=rank))
    a, b = slots.acquire("a"), slots.acquire("b")
    token_slots = [a, a, a, a, b, b, b, -1, a, b]  # runs of one adapter, another, the base model
    _prefill(model, storage, g, prompts)
    ids = torch.randint(0, model.config.vocab_size, (len(prompts),), generator=g)
    rows = torch.arange(len(prompts))
    lora = StepLora(slots, LoraBatchIndex.from_token_slots(token_slots, torch.device("cpu")))
    with_lora = _both_paths(model, storage, ids, rows, monkeypatch, lora, prompts)
    base = _both_paths(model, storage, ids, rows, monkeypatch, prompts=prompts)
    for i, slot in enumerate(token_slots):
        assert torch.equal(with_lora[i], base[i]) == (slot < 0)


@SLOT_DTYPES
def test_a_wide_batch_of_many_adapters_on_two_threads_matches_the_per_op_path(tmp_path, monkeypatch, slot_dtype):
    """40 rows over six adapters of ranks 4 to 32 and the base model, on GEMMs wide enough for both
    threads (tiny-wide): lora.c splits each phase between the threads by cost, so shares cut adapters'
    rows and tiles; the step stays bit-identical to the per-op path. Adapter a holds 17 tokens (a
    block of 16+, so its shrink takes the tile kernel; rank 20, a whole tile and a part; no fold at
    under half)."""
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        g = torch.Generator().manual_seed(7)
        prompts = tuple(int(n) for n in torch.randint(2, 60, (40,), generator=g))
        model, storage = _model_and_cache("tiny-wide", len(prompts))
        slots = LoraSlots(model.config, max_loras=6, max_lora_rank=32, max_cpu_loras=6, dtype=slot_dtype)
        specs = (("a", 20, "all"), ("b", 8, ("q", "v", "gate", "down")), ("c", 4, "all"), ("d", 16, "all"),
                 ("e", 32, ("k", "o", "up")), ("f", 16, "all"))
        for name, rank, targets in specs:
            slots.register(name, make_peft_dir(tmp_path / name, model.config, rank, 16, targets, seed=rank + 1))
        a, b, c, d, e, f = (slots.acquire(name) for name, _, _ in specs)
        token_slots = [a] * 17 + [b] * 6 + [c] * 3 + [d, e, f] + [-1] * 11
        token_slots = [token_slots[i] for i in torch.randperm(40, generator=g)]  # groups are gathered rows
        _prefill(model, storage, g, prompts)
        ids = torch.randint(0, model.config.vocab_size, (len(prompts),), generator=g)
        rows = torch.arange(len(prompts))
        lora = StepLora(slots, LoraBatchIndex.from_token_slots(token_slots, torch.device("cpu")))
        assert lora.kernel_args()[2] is None  # no fold: every group is lora.c's
        with_lora = _both_paths(model, storage, ids, rows, monkeypatch, lora, prompts)
        base = _both_paths(model, storage, ids, rows, monkeypatch, prompts=prompts)
        for i, slot in enumerate(token_slots):
            assert torch.equal(with_lora[i], base[i]) == (slot < 0)
    finally:
        torch.set_num_threads(prev_threads)


def _fold_setup(tmp_path, slot_dtype=torch.float32, packed_dtype=torch.float32, blocks=None, preset="tiny"):
    """12 sequences, 8 of them on adapter a (rank 12: two shrink panels for qkv), 2 on b, 2 on the base."""
    g = torch.Generator().manual_seed(6)
    prompts = (5, 20, 33, 7, 16, 17, 2, 40, 9, 31, 12, 3)
    model, storage = _model_and_cache(preset, len(prompts), packed_dtype, blocks)
    slots = LoraSlots(model.config, max_loras=3, max_lora_rank=16, max_cpu_loras=3, dtype=slot_dtype)
    for name, rank in (("a", 12), ("b", 4)):
        slots.register(name, make_peft_dir(tmp_path / name, model.config, rank, 2 * rank, "all", seed=rank))
    a, b = slots.acquire("a"), slots.acquire("b")
    token_slots = [a, b, a, a, -1, a, a, b, a, a, -1, a]
    _prefill(model, storage, g, prompts)
    ids = torch.randint(0, model.config.vocab_size, (len(prompts),), generator=g)
    lora = StepLora(slots, LoraBatchIndex.from_token_slots(token_slots, torch.device("cpu")))
    return model, storage, slots, lora, token_slots, ids, prompts


@SLOT_DTYPES
def test_an_adapter_holding_most_of_the_batch_is_folded_into_the_gemms(tmp_path, monkeypatch, slot_dtype):
    """Its rows (logits and K/V) match the per-op path to rounding (the delta is summed in another
    order; 16-bit slots are widened into the fp32 fold exactly); the base model's and the other
    adapter's rows stay bit-identical."""
    model, storage, slots, lora, token_slots, ids, prompts = _fold_setup(tmp_path, slot_dtype)
    fold = lora.kernel_args()[2]
    assert fold is not None and fold[0] == token_slots[0]
    rows, before = torch.arange(len(prompts)), storage.clone()
    fused = _decode(model, storage, ids, rows, lora, True, monkeypatch, prompts)
    fused_cache = storage.clone()
    storage.copy_(before)
    per_op = _decode(model, storage, ids, rows, lora, False, monkeypatch, prompts)
    storage.copy_(before)
    base = _decode(model, storage, ids, rows, None, True, monkeypatch, prompts)
    for i, slot in enumerate(token_slots):
        if slot == fold[0]:
            torch.testing.assert_close(fused[i], per_op[i], rtol=1e-4, atol=1e-4)
            assert not torch.allclose(fused[i], base[i])
        else:
            assert torch.equal(fused[i], per_op[i])
    storage.copy_(before)
    _decode(model, storage, ids, rows, lora, False, monkeypatch, prompts)
    torch.testing.assert_close(fused_cache, storage, rtol=1e-4, atol=1e-4)


def test_a_fold_packed_for_another_rank_is_refused_and_writes_nothing(tmp_path, monkeypatch):
    model, storage, slots, lora, token_slots, ids, prompts = _fold_setup(tmp_path)
    slot, block = slots.fold_for(lora.index)
    monkeypatch.setattr(slots, "fold_for", lambda index, table=None: (slot, block[:-1]))
    before = storage.clone()
    with pytest.raises(ValueError, match="refused"):
        _decode(model, storage, ids, torch.arange(len(prompts)), lora, True, monkeypatch, prompts)
    assert torch.equal(before, storage)


def test_fused_decode_step_refuses_a_bad_index_and_writes_nothing(monkeypatch):
    g = torch.Generator().manual_seed(2)
    model, storage = _model_and_cache("tiny")
    _prefill(model, storage, g)
    before = storage.clone()
    meta = build_metadata([(n, 1, _blocks(i)) for i, n in enumerate(PROMPTS)], BLOCK, torch.device("cpu"))
    ids, rows = torch.zeros(len(PROMPTS), dtype=torch.long), torch.arange(len(PROMPTS))
    for field, bad in (("slot_mapping", 16 * BLOCK), ("decode_blocks", 99), ("decode_lens", 10**6)):
        broken = getattr(meta, field).clone()
        broken.view(-1)[-1] = bad
        monkeypatch.setattr(meta, field, broken)
        with pytest.raises(ValueError, match="out of range"):
            model.forward(ids, torch.tensor(PROMPTS), meta, layer_views(storage), rows)
        monkeypatch.undo()
    with pytest.raises(ValueError, match="out of range"):  # positions past the RoPE table
        model.forward(ids, torch.tensor([0, 1, 10**6]), meta, layer_views(storage), rows)
    assert torch.equal(storage, before)


def test_batches_above_the_packed_kernels_rows_take_the_per_op_path(monkeypatch):
    g = torch.Generator().manual_seed(3)
    model, storage = _model_and_cache("tiny")
    _prefill(model, storage, g)
    meta = build_metadata([(n, 1, _blocks(i)) for i, n in enumerate(PROMPTS)], BLOCK, torch.device("cpu"))
    ids = torch.zeros(len(PROMPTS), dtype=torch.long)
    monkeypatch.setattr(linear, "PACKED_MAX_ROWS", 2)
    assert model.ops.decode_step(model, ids, torch.tensor(PROMPTS), meta, layer_views(storage),
                                 torch.arange(3), None) is None
