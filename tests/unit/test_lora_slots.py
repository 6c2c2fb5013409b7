"""Device slots: exact kernel layout, LRU tiers, pinning, refcounts, and agreement with merged weights.

The slots and the model's weights live on the test device (--device); adapter files, the CPU tier and
the expected values stay on the CPU, where slot contents are compared.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loraplex.engine.kernels.lora_ops import LoraBatchIndex
from loraplex.engine.lora.merge import merged_weights
from loraplex.engine.lora.peft import AdapterError, AdapterInUseError, AdapterNotFoundError, load_peft_adapter
from loraplex.engine.lora.slots import LoraSlots
from tests.conftest import _loaded, test_device
from tests.lora_factory import make_peft_dir, read_tensors, tensor_key, write_tensors

FUSED = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}


@pytest.fixture(scope="module")
def tiny(device):
    return _loaded("synthetic:tiny", device)


@pytest.fixture(scope="module")
def config(tiny):
    return tiny.config


def widths(config):
    q, kv, i, h = config.q_size, config.kv_size, config.intermediate_size, config.hidden_size
    return {"q": q, "k": kv, "v": kv, "o": h, "gate": i, "up": i, "down": h}


def make(config, max_loras=2, r_max=16, max_cpu=4, **kw) -> LoraSlots:
    return LoraSlots(config, max_loras=max_loras, max_lora_rank=r_max, max_cpu_loras=max_cpu, device=test_device(),
                     **kw)


def register(slots, tmp_path, name, rank=8, alpha=16, targets="all", seed=0, **kw):
    path = make_peft_dir(tmp_path / name, slots.config, rank, alpha, targets, seed, **kw)
    slots.register(name, path)
    return path


def test_buffer_shapes_match_kernel_layout(config):
    slots = make(config, max_loras=3, r_max=8)
    h, q, kv, i = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    expected = {"qkv": ((3, 24, h), (3, q + 2 * kv, 8)), "o": ((3, 8, q), (3, h, 8)),
                "gate_up": ((3, 16, h), (3, 2 * i, 8)), "down": ((3, 8, i), (3, h, 8))}
    for layer in range(config.num_layers):
        for module, (a_shape, b_shape) in expected.items():
            a, b = slots.buffers(layer, module)
            assert tuple(a.shape) == a_shape and tuple(b.shape) == b_shape
            assert not a.any() and not b.any()
    assert slots.slice_widths("qkv") == (q, kv, kv) and slots.slice_widths("gate_up") == (i, i)
    assert slots.slice_widths("o") == (h,) and slots.slice_widths("down") == (h,)
    assert slots.ranks.dtype == torch.int32 and slots.ranks.tolist() == [0, 0, 0]


def check_slot(slots, slot, lora):
    """Every row and column of the slot: A and scaling*B where the adapter has them, zero elsewhere."""
    r_max, w = slots.r_max, widths(slots.config)
    assert int(slots.ranks[slot]) == lora.rank
    for layer in range(slots.config.num_layers):
        for fused, modules in FUSED.items():
            a_buf, b_buf = (t[slot].float().cpu() for t in slots.buffers(layer, fused))
            exp_a, exp_b = torch.zeros_like(a_buf), torch.zeros_like(b_buf)
            off = 0
            for s, m in enumerate(modules):
                if (layer, m) in lora.offsets:  # (each module at its own rank and scaling)
                    rank = lora.rank_of(layer, m)
                    exp_a[s * r_max:s * r_max + rank] = lora.a(layer, m)
                    exp_b[off:off + w[m], :rank] = lora.scaling_of(layer, m) * lora.b(layer, m)
                off += w[m]
            assert off == b_buf.shape[0]
            torch.testing.assert_close(a_buf, exp_a.to(slots.dtype).float(), rtol=0, atol=0)
            torch.testing.assert_close(b_buf, exp_b.to(slots.dtype).float(), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slot_holds_a_and_scaled_b_in_fused_rows(tmp_path, config, dtype):
    slots = make(config, r_max=16, dtype=dtype)
    path = register(slots, tmp_path, "a", rank=8, alpha=32, seed=1)
    slot = slots.acquire("a")
    lora = load_peft_adapter(path, config)
    assert lora.scaling == 4.0 and slots.lora_a[0]["qkv"].dtype == dtype
    check_slot(slots, slot, lora)
    # spot-check the qkv slices by hand: k's A sits at rows r_max.., k's B at rows q_size..q_size+kv_size
    raw = read_tensors(path)
    q, kv, r = config.q_size, config.kv_size, slots.r_max
    a, b = slots.buffers(1, "qkv")
    assert torch.equal(a[slot, r:r + 8].float().cpu(), raw[tensor_key(1, "k", "A")].to(dtype).float())
    assert torch.equal(b[slot, q:q + kv, :8].float().cpu(), (4.0 * raw[tensor_key(1, "k", "B")]).to(dtype).float())
    assert not a[slot, r + 8:2 * r].any() and not b[slot, :, 8:].any()
    assert not a[1 - slot].any() and int(slots.ranks[1 - slot]) == 0


def test_untargeted_modules_and_layers_stay_zero(tmp_path, config):
    slots = make(config)
    path = register(slots, tmp_path, "a", rank=4, targets=["k", "up"], layers_to_transform=[1])
    slot = slots.acquire("a")
    check_slot(slots, slot, load_peft_adapter(path, config))
    for module in FUSED:
        a, b = slots.buffers(0, module)
        assert not a[slot].any() and not b[slot].any()
    a, b = slots.buffers(1, "o")
    assert not a[slot].any() and not b[slot].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # one C call / torch ops per block
def test_loading_overwrites_the_whole_slot(tmp_path, config, dtype):
    slots = make(config, max_loras=1, r_max=16, dtype=dtype)
    register(slots, tmp_path, "big", rank=16, targets="all", seed=2)
    small = register(slots, tmp_path, "small", rank=4, targets=["v"], seed=3)
    mid = register(slots, tmp_path, "mid", rank=8, targets=["q", "down"], seed=4)
    assert slots.acquire("big") == 0
    slots.release("big")
    assert slots.acquire("small") == 0
    check_slot(slots, 0, load_peft_adapter(small, config))  # nothing of "big" is left
    assert slots.slot_of("big") is None and slots.stats.evictions == 1
    slots.release("small")
    assert slots.acquire("mid") == 0  # a larger rank over a smaller one
    check_slot(slots, 0, load_peft_adapter(mid, config))
    slots.release("mid")
    slots.unregister("mid")  # frees the slot: all zero again
    assert int(slots.ranks[0]) == 0
    for layer in range(config.num_layers):
        for module in FUSED:
            assert not any(t[0].any() for t in slots.buffers(layer, module))
    assert slots.acquire("big") == 0
    check_slot(slots, 0, load_peft_adapter(tmp_path / "big", config))


def test_a_block_table_is_reused_by_adapters_of_one_shape_in_any_slot(tmp_path, config):
    """The slot write's block table depends on the adapter's layout, its rank and what the slot held,
    not on the slot or the adapter's values: adapters of one shape reuse it, and each lands exactly."""
    slots = make(config, max_loras=3, r_max=16)
    for name, rank, seed in (("a", 8, 1), ("b", 8, 2), ("c", 16, 3), ("d", 8, 4)):
        register(slots, tmp_path, name, rank=rank, seed=seed)
    loras = {name: load_peft_adapter(tmp_path / name, config) for name in "abcd"}
    first = slots._slot_blocks(0, slots._cpu["a"])
    assert slots._slot_blocks(2, slots._cpu["b"]) is first  # same shape, another slot: the same table
    assert slots._slot_blocks(0, slots._cpu["c"]) is not first  # another rank: another table
    for name, slot in (("a", 0), ("b", 1), ("c", 2)):
        assert slots.acquire(name) == slot
        check_slot(slots, slot, loras[name])
        slots.release(name)
    assert slots._slot_blocks(2, slots._cpu["d"]) is not first  # slot 2 held rank 16: rows 8-15 to zero
    assert slots.acquire("d") == 0  # evicts a (LRU) from slot 0, which held the same shape
    check_slot(slots, 0, loras["d"])
    slots.unregister("c")  # slot 2 zeroed by its own table
    assert not any(t[2].any() for layer in range(config.num_layers) for f in FUSED for t in slots.buffers(layer, f))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_module_ranks_and_alphas_land_in_one_slot_and_match_merged_weights(tmp_path, tiny, dtype):
    """rank_pattern / alpha_pattern: each module at its own rank (rows up to the adapter's largest rank
    zero, even over what a rank-16 adapter left) and its own scaling."""
    config = tiny.config
    slots = make(config, max_loras=1, r_max=16, dtype=dtype)
    register(slots, tmp_path, "wide", rank=16, seed=1)
    assert slots.acquire("wide") == 0
    slots.release("wide")
    patterns = {"rank_pattern": {"q_proj": 4, r"layers\.1\.mlp\.down_proj": 12}, "alpha_pattern": {"v_proj": 24}}
    path = register(slots, tmp_path, "mixed", rank=8, alpha=16, seed=2,
                    ranks=lambda layer, m: 4 if m == "q" else 12 if (layer, m) == (1, "down") else 8, **patterns)
    lora = load_peft_adapter(path, config)
    assert lora.rank == 12 and lora.rank_of(0, "q") == 4 and lora.rank_of(0, "down") == 8
    assert (lora.scaling, lora.scaling_of(1, "v"), lora.scaling_of(1, "down"), lora.scaling_of(0, "q")) == \
        (2.0, 3.0, 16 / 12, 4.0)
    assert slots.acquire("mixed") == 0  # evicts "wide"
    check_slot(slots, 0, lora)
    merged = merged_weights(tiny.weights, config, lora)
    index = LoraBatchIndex.from_token_slots([0, -1, 0], slots.device)
    gen = torch.Generator().manual_seed(0)
    for layer in range(config.num_layers):
        for fused in FUSED:
            base = tiny.weights[f"layers.{layer}.{fused}"]
            x = torch.randn(3, base.shape[1], generator=gen).to(base.device)
            out = F.linear(x, base)
            slots.apply(layer, fused, x.to(dtype), out_typed := out.to(dtype), index)
            expected = torch.stack([F.linear(x[0], merged[f"layers.{layer}.{fused}"]), F.linear(x[1], base),
                                    F.linear(x[2], merged[f"layers.{layer}.{fused}"])])
            tol = 1e-5 if dtype == torch.float32 else 3e-2
            torch.testing.assert_close(out_typed.float(), expected, rtol=tol, atol=tol)


def test_apply_matches_merged_weights(tmp_path, tiny):
    """Per-token slots (two adapters and base rows) give exactly the merged model's projections."""
    config = tiny.config
    slots = make(config, max_loras=3, r_max=16)
    loras = {}
    for name, rank, targets, seed in (("a", 8, "all", 4), ("b", 16, ["q", "v", "gate", "down"], 5)):
        path = register(slots, tmp_path, name, rank=rank, targets=targets, seed=seed)
        loras[slots.acquire(name)] = merged_weights(tiny.weights, config, load_peft_adapter(path, config))
    token_slots = [0, 0, 0, -1, 1, 1, -1, 0, 1]
    index = LoraBatchIndex.from_token_slots(token_slots, slots.device)
    gen = torch.Generator().manual_seed(0)
    for layer in range(config.num_layers):
        for fused in FUSED:
            name = f"layers.{layer}.{fused}"
            base = tiny.weights[name]
            x = torch.randn(len(token_slots), base.shape[1], generator=gen).to(base.device)
            out = F.linear(x, base)
            slots.apply(layer, fused, x, out, index)
            expected = torch.stack([F.linear(x[t], loras[s][name] if s >= 0 else base)
                                    for t, s in enumerate(token_slots)])
            torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
            assert not torch.allclose(out, F.linear(x, base), atol=1e-3)  # the adapters do change outputs


def test_buffers_take_the_largest_loaded_rank_and_grow_keeping_loaded_slots(tmp_path, tiny):
    """The buffers' rank follows the largest adapter loaded (rounded up to 8), not max_lora_rank: a
    registration alone does not grow them, a load does, and the slots already loaded keep their rows
    and their deltas bit for bit."""
    config = tiny.config
    slots = make(config, max_loras=3, r_max=64)
    assert slots.r_max == 8 and slots.buffers(0, "o")[1].shape[2] == 8
    small = register(slots, tmp_path, "small", rank=4, seed=7)
    s_small = slots.acquire("small")
    assert slots.r_max == 8
    index = LoraBatchIndex.from_token_slots([s_small, -1, s_small], slots.device)
    gen = torch.Generator().manual_seed(3)
    xs = {f: torch.randn(3, slots.buffers(0, f)[0].shape[2], generator=gen).to(slots.device) for f in FUSED}

    def deltas():
        outs = {}
        for f, x in xs.items():
            outs[f] = torch.zeros(3, slots.buffers(0, f)[1].shape[1], device=slots.device)
            slots.apply(0, f, x, outs[f], index)
        return outs

    before, table = deltas(), slots.kernel_table()
    big = register(slots, tmp_path, "big", rank=20, seed=8)
    assert slots.r_max == 8  # registered, not loaded
    s_big = slots.acquire("big")
    assert slots.r_max == 24 and slots.lora_a[1]["qkv"].shape[1] == 3 * 24
    check_slot(slots, s_small, load_peft_adapter(small, config))
    check_slot(slots, s_big, load_peft_adapter(big, config))
    after = deltas()
    assert before["o"].any()
    for f in FUSED:  # the C kernel reads each slot's own rank rows only: the same bits; torch ops (kernels off)
        if table is not None:  # and the Triton kernels (CUDA) reduce over r_max columns, whose blocking may round
            assert torch.equal(before[f], after[f])
        else:
            torch.testing.assert_close(before[f], after[f], rtol=1e-6, atol=1e-6)
    if table is not None:  # the C kernels are built: a table of the old buffers is replaced, not reused
        assert slots.kernel_table() is not table and int(slots.kernel_table().table[1]) == 24
    capped = make(config, max_loras=1, r_max=12)
    register(capped, tmp_path, "twelve", rank=12, seed=9)
    capped.acquire("twelve")
    assert capped.r_max == 12  # never beyond max_lora_rank


def test_merged_weights_is_w_plus_scaled_ba(tmp_path, tiny):
    config = tiny.config
    path = make_peft_dir(tmp_path, config, 8, 16, ["q", "v", "up", "o"], 6, layers_to_transform=[0])
    lora = load_peft_adapter(path, config)
    merged = merged_weights(tiny.weights, config, lora)
    q, kv, i = config.q_size, config.kv_size, config.intermediate_size
    w = tiny.weights
    dev = w["embed"].device
    d = {m: (2.0 * lora.b(0, m) @ lora.a(0, m)).to(dev) for m in ("q", "v", "up", "o")}  # (computed on the CPU)
    expected_qkv = w["layers.0.qkv"] + torch.cat([d["q"], torch.zeros(kv, config.hidden_size, device=dev), d["v"]])
    torch.testing.assert_close(merged["layers.0.qkv"], expected_qkv)
    torch.testing.assert_close(merged["layers.0.gate_up"][:i], w["layers.0.gate_up"][:i])
    torch.testing.assert_close(merged["layers.0.gate_up"][i:], w["layers.0.gate_up"][i:] + d["up"])
    torch.testing.assert_close(merged["layers.0.o"], w["layers.0.o"] + d["o"])
    for name in ("layers.0.down", "layers.1.qkv", "layers.1.o", "embed"):
        assert merged[name] is w[name]  # untouched tensors are shared, not copied
    assert not torch.equal(merged["layers.0.qkv"][:q], w["layers.0.qkv"][:q])  # base dict not modified


def test_lru_eviction_order(tmp_path, config):
    slots = make(config, max_loras=2)
    for i, name in enumerate("abc"):
        register(slots, tmp_path, name, seed=i)
    for name in ("a", "b", "a"):  # b is now least recently used
        slots.acquire(name)
        slots.release(name)
    slot_b = slots.slot_of("b")
    assert slots.acquire("c") == slot_b
    assert slots.slot_of("b") is None and slots.loaded() == ["a", "c"]
    slots.release("c")
    slots.acquire("b")  # a is LRU now
    assert slots.slot_of("a") is None and slots.stats.evictions == 2 and slots.stats.loads == 4


def test_busy_slots_are_never_evicted_and_acquire_returns_none(tmp_path, config):
    slots = make(config, max_loras=2)
    for i, name in enumerate("abc"):
        register(slots, tmp_path, name, seed=i)
    sa, sb = slots.acquire("a"), slots.acquire("b")
    assert {sa, sb} == {0, 1}
    stats = (slots.stats.loads, slots.stats.evictions)
    assert slots.acquire("c") is None  # every slot busy: the scheduler waits
    assert (slots.stats.loads, slots.stats.evictions) == stats and slots.loaded() == ["a", "b"]
    assert slots.acquire("a") == sa and slots.refcount("a") == 2  # a second request shares the slot
    slots.release("a")
    slots.release("a")
    assert slots.acquire("c") == sa and slots.slot_of("b") == sb
    with pytest.raises(RuntimeError, match="without a matching acquire"):
        slots.release("a")


def test_pinned_adapter_is_never_evicted(tmp_path, config):
    slots = make(config, max_loras=2)
    for i, name in enumerate("pabc"):
        register(slots, tmp_path, name, seed=i)
    slot_p = slots.pin("p")
    assert slots.is_pinned("p") and slots.slot_of("p") == slot_p and slots.refcount("p") == 0
    for name in ("a", "b", "c"):  # each evicts the previous unpinned adapter, never p
        assert slots.acquire(name) == 1 - slot_p
        slots.release(name)
    assert slots.slot_of("p") == slot_p
    slots.acquire("c")
    assert slots.acquire("a") is None  # one slot pinned, the other busy
    with pytest.raises(AdapterInUseError, match="cannot pin"):
        slots.pin("a")
    slots.release("c")
    slots.unpin("p")  # unpinned, p is simply the least recently used adapter
    assert slots.acquire("a") == slot_p and slots.slot_of("p") is None and slots.slot_of("c") == 1 - slot_p


def test_unregister_refused_while_acquired(tmp_path, config):
    slots = make(config)
    register(slots, tmp_path, "a")
    slot = slots.acquire("a")
    with pytest.raises(AdapterInUseError, match="in use") as info:
        slots.unregister("a")
    assert info.value.code == "adapter_in_use" and slots.slot_of("a") == slot
    slots.release("a")
    slots.unregister("a")
    assert "a" not in slots and slots.slot_of("a") is None and int(slots.ranks[slot]) == 0
    assert not slots.buffers(0, "qkv")[0][slot].any()
    with pytest.raises(AdapterNotFoundError):
        slots.acquire("a")
    with pytest.raises(AdapterNotFoundError):
        slots.unregister("a")


def test_bad_adapter_refused_at_registration_and_nothing_changes(tmp_path, config):
    slots = make(config, r_max=8)
    register(slots, tmp_path, "good", rank=8)
    before = (slots.adapter_ids(), slots.cpu_cached(), slots.loaded(), slots.ranks.clone())
    bad = make_peft_dir(tmp_path / "bad", config, 16, 16, "all", 1)  # rank above max_lora_rank
    with pytest.raises(AdapterError, match="r must"):
        slots.register("bad", bad)
    nan = make_peft_dir(tmp_path / "nan", config, 4, 8, ["q"], 2)
    tensors = read_tensors(nan)
    tensors[tensor_key(1, "q", "B")][0, 0] = float("nan")
    write_tensors(nan, tensors)
    with pytest.raises(AdapterError, match="non-finite"):
        slots.register("nan", nan)
    with pytest.raises(AdapterError, match="already registered"):
        slots.register("good", bad)
    after = (slots.adapter_ids(), slots.cpu_cached(), slots.loaded(), slots.ranks)
    assert after[:3] == before[:3] and torch.equal(after[3], before[3])


def test_cpu_tier_hits_and_disk_reloads(tmp_path, config):
    slots = make(config, max_loras=1, max_cpu=2)
    paths = {name: register(slots, tmp_path, name, seed=i) for i, name in enumerate("abc")}
    assert slots.cpu_cached() == ["b", "c"]  # a dropped from the CPU tier, re-read from disk on demand
    slots.acquire("a")
    assert (slots.stats.disk_loads, slots.stats.cpu_hits) == (1, 0) and slots.cpu_cached() == ["c", "a"]
    slots.release("a")
    slots.acquire("c")
    assert (slots.stats.disk_loads, slots.stats.cpu_hits) == (1, 1) and slots.cpu_cached() == ["a", "c"]
    slots.release("c")
    assert 0 < slots.stats.last_load_ms / 1000 < slots.stats.load_seconds  # (the total holds both loads)
    # a disk reload serves the files as registered: rewritten (here broken too), they are refused before
    # any read, and the loaded slot is left alone
    tensors = read_tensors(paths["b"])
    tensors[tensor_key(0, "q", "A")] = torch.zeros(3, config.hidden_size)
    write_tensors(paths["b"], tensors)
    with pytest.raises(AdapterError, match="changed since it was registered"):
        slots.acquire("b")
    assert slots.stats.disk_loads == 1
    assert slots.slot_of("c") == 0 and slots.stats.evictions == 1 and slots.refcount("b") == 0


def test_zero_cpu_tier_always_reads_disk(tmp_path, config):
    slots = make(config, max_loras=1, max_cpu=0)
    register(slots, tmp_path, "a")
    for _ in range(2):
        slots.acquire("a")
        slots.release("a")
    assert (slots.stats.disk_loads, slots.stats.cpu_hits, slots.stats.loads) == (1, 0, 1)
    assert slots.cpu_cached() == []


def test_constructor_checks(config):
    with pytest.raises(ValueError, match="max_loras"):
        make(config, max_loras=0)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        make(config, max_cpu=-1)


def test_half_precision_adapter_lands_exactly_from_its_converted_copy(tmp_path, config):
    """An fp16 file is converted into a new fp32 tensor (tensors back to back, not at the file's offsets)."""
    slots = make(config, max_loras=1, r_max=16)
    path = register(slots, tmp_path, "a", rank=8, seed=5, dtype=torch.float16)
    lora = load_peft_adapter(path, config)
    assert lora.buffer is None and lora.values.dtype == torch.float32
    check_slot(slots, slots.acquire("a"), lora)


@pytest.mark.parametrize("max_cpu", [0, 1])
def test_disk_reads_recycle_the_buffer_of_an_adapter_that_left_the_cpu_tier(tmp_path, config, max_cpu):
    slots = make(config, max_loras=1, r_max=16, max_cpu=max_cpu)
    for seed, name in enumerate("abc"):
        register(slots, tmp_path, name, rank=8, seed=seed)
    assert slots.cpu_cached() == ["c"][:max_cpu]
    assert slots._spare is not None  # the buffer of the latest adapter to leave the tier
    spare = slots._spare.data_ptr()
    for name in "acab":  # each a disk read into a recycled buffer, then a slot write from it
        slot = slots.acquire(name)
        lora = slots._cpu.get(name) if max_cpu else None
        if lora is not None:
            assert lora.buffer.untyped_storage().data_ptr() == spare  # read into the spare
        check_slot(slots, slot, load_peft_adapter(tmp_path / name, config))
        slots.release(name)
        spare = slots._spare.data_ptr()
    assert slots.stats.disk_loads == 4


@pytest.mark.cpu_kernels
def test_the_dominant_adapter_is_packed_once_for_folding_and_repacked_after_its_slot_is_rewritten(tmp_path, config):
    from loraplex.engine.kernels.cpu.decode_step import decode_step_available
    from loraplex.engine.lora.slots import FOLD_MIN_SHARE, FOLD_MIN_TOKENS

    if not decode_step_available():
        pytest.skip("the CPU kernels are not built")
    slots = make(config, max_loras=1, r_max=16)
    register(slots, tmp_path, "a", rank=8)
    slot = slots.acquire("a")
    many = LoraBatchIndex.from_token_slots([slot] * FOLD_MIN_TOKENS + [-1] * 2)
    first = slots.fold_for(many)
    assert first[0] == slot and torch.equal(first[1], slots.kernel_table().pack_fold(slot))
    assert slots.fold_for(many)[1] is first[1]  # packed once
    assert slots.fold_for(LoraBatchIndex.from_token_slots([slot] * (FOLD_MIN_TOKENS - 1))) is None
    too_few = int(FOLD_MIN_TOKENS / FOLD_MIN_SHARE) + 1
    assert slots.fold_for(LoraBatchIndex.from_token_slots([slot] * FOLD_MIN_TOKENS + [-1] * too_few)) is None
    slots.release("a")
    register(slots, tmp_path, "b", rank=4, seed=1)
    assert slots.acquire("b") == slot  # "a" evicted: the slot rewritten at another rank
    second = slots.fold_for(many)
    assert second[1].numel() < first[1].numel()
    assert torch.equal(second[1], slots.kernel_table().pack_fold(slot))
