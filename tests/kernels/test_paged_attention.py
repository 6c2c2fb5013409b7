"""Paged attention kernels (Triton on the test device; on the CPU under TRITON_INTERPRET=1) against
kernels/paged_attention_ref.py: ragged
batches of decode rows, draft rows and prefill chunks (fresh, prefix-cache hits, chunked continuations), GQA
ratios, head dims, block sizes, dtypes, split-KV, strided q/out, scattered block tables, bad inputs.

Cache slots no sequence wrote hold NaN and block-table padding points at an all-NaN block, so a key read past
a row's context (or through padding) poisons the output instead of passing unnoticed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from loraplex.engine.kernels.lora_ops import triton_available
from loraplex.engine.kernels.paged_attention import (
    PREFILL_BLOCK_M,
    choose_num_splits,
    paged_decode_attention,
    paged_prefill_attention,
    prefill_tiles,
)
from loraplex.engine.kernels.paged_attention_ref import context_slots, paged_attention_ref
from tests.conftest import test_device

DEVICE = test_device()
assert triton_available(DEVICE), "tests/conftest.py sets TRITON_INTERPRET=1 on the CPU"

TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (3e-3, 3e-3), torch.bfloat16: (2e-2, 2e-2)}
SENTINEL = 7.0  # rows of out no call computes keep it
# (kind, computed, new): "d" = decode rows (one per new token, lens computed+1 .. computed+new), "p" = a prefill chunk
MIXED = [
    ("d", 40, 1),  # decode spanning blocks
    ("p", 0, 37),  # fresh prompt: two query tiles
    ("d", 0, 1),  # lens == 1
    ("d", 21, 3),  # draft rows: lens 22, 23, 24 over one block table
    ("p", 32, 20),  # prefix-cache hit, block aligned
    ("p", 45, 19),  # chunked prefill continuing mid-block
]


def i32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


@dataclass
class Case:
    """One step's inputs for both kernels plus the reference's description of every computed row."""

    q: torch.Tensor  # [tokens, heads, head_dim], maybe a view into a fused qkv buffer
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [seqs, max_blocks] int32, rows shuffled relative to the sequences
    ref_seqs: list[tuple[int, int, int, list[int]]]
    decode: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # rows, lens, row_table
    max_len: int
    prefill: tuple[torch.Tensor, ...]  # tile_seq, tile_start, seq_rows, seq_new, seq_computed, seq_table
    scale: float


def make_case(specs, heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
              seed: int = 0, fused: bool = True) -> Case:
    """Sequences laid out in spec order; blocks drawn from a shuffled pool; decode rows listed out of order."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    need = [-(-(c + n) // block_size) for _, c, n in specs]
    num_blocks = sum(need) + 3
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    poison = pool.pop()  # all-NaN block, used as block-table padding
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    v_cache = k_cache.clone()
    tokens = sum(n for _, _, n in specs)
    width = (heads + 2 * kv_heads) * head_dim if fused else heads * head_dim
    q = torch.randn(tokens, width, generator=g).to(DEVICE, dtype)[:, :heads * head_dim].view(tokens, heads, head_dim)
    table_of = list(range(len(specs)))
    rng.shuffle(table_of)
    tables = [[poison] * (max(need) + 1) for _ in specs]
    ref_seqs, dec, pre = [], [], []
    row = 0
    for i, (kind, computed, new) in enumerate(specs):
        blocks = [pool.pop() for _ in range(need[i])]
        tables[table_of[i]][:need[i]] = blocks
        slots = torch.tensor(context_slots(blocks, computed + new, block_size), device=DEVICE)
        shape = (len(slots), kv_heads, head_dim)
        k_cache.view(-1, kv_heads, head_dim)[slots] = torch.randn(shape, generator=g).to(DEVICE, dtype)
        v_cache.view(-1, kv_heads, head_dim)[slots] = torch.randn(shape, generator=g).to(DEVICE, dtype)
        ref_seqs.append((row, new, computed, blocks))
        if kind == "d":
            dec.extend((row + j, computed + j + 1, table_of[i]) for j in range(new))
        else:
            pre.append((row, new, computed, table_of[i]))
        row += new
    rng.shuffle(dec)
    tile_seq, tile_start = prefill_tiles([n for _, n, _, _ in pre])
    return Case(q, k_cache, v_cache, i32(tables), ref_seqs,
                tuple(i32([d[j] for d in dec]) for j in range(3)), max((d[1] for d in dec), default=0),
                (i32(tile_seq), i32(tile_start), *(i32([p[j] for p in pre]) for j in range(4))),
                head_dim ** -0.5)


def new_out(case: Case, fused: bool = True) -> torch.Tensor:
    """Sentinel-filled output, a strided view (row stride wider than heads * head_dim) when fused."""
    tokens, heads, head_dim = case.q.shape
    width = (heads + 1) * head_dim if fused else heads * head_dim
    buf = torch.full((tokens, width), SENTINEL, dtype=case.q.dtype, device=DEVICE)
    return buf[:, head_dim:].view(tokens, heads, head_dim) if fused else buf.view(tokens, heads, head_dim)


def run_decode(case: Case, out: torch.Tensor, num_splits: int | None = None) -> None:
    paged_decode_attention(case.q, case.k_cache, case.v_cache, out, *case.decode, case.block_tables, case.scale,
                           case.max_len, num_splits=num_splits)


def run_prefill(case: Case, out: torch.Tensor) -> None:
    paged_prefill_attention(case.q, case.k_cache, case.v_cache, out, *case.prefill, case.block_tables, case.scale)


def check(case: Case, out: torch.Tensor, rows: list[int] | None = None) -> None:
    """out matches the reference on the given rows (all by default) and still holds the sentinel elsewhere."""
    ref = paged_attention_ref(case.q, case.k_cache, case.v_cache, case.ref_seqs, case.scale)
    rows = list(range(out.shape[0])) if rows is None else rows
    atol, rtol = TOL[case.q.dtype]
    torch.testing.assert_close(out[rows].float(), ref[rows].float(), atol=atol, rtol=rtol)
    rest = sorted(set(range(out.shape[0])) - set(rows))
    assert torch.all(out[rest] == SENTINEL), "rows outside the call were written"


# heads, kv_heads, head_dim, block_size, dtype, fused q/out
CONFIGS = [
    (2, 2, 64, 16, torch.float32, True),  # MHA
    (6, 2, 128, 32, torch.bfloat16, True),  # GQA 3: a padded head in the prefill head stack
    (8, 1, 64, 16, torch.float16, False),  # GQA 8
    (8, 1, 128, 32, torch.float32, True),  # GQA 8 over two prefill head chunks (fp32 stacks fewer heads)
    (3, 1, 80, 16, torch.float16, True),  # non-power-of-two head_dim, GQA 3
    (4, 2, 16, 16, torch.bfloat16, False),  # the engine's tiny test models
]


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,dtype,fused", CONFIGS,
                         ids=[f"h{c[0]}kv{c[1]}d{c[2]}b{c[3]}-{str(c[4])[6:]}{'-fused' * c[5]}" for c in CONFIGS])
def test_mixed_batch_matches_reference(heads, kv_heads, head_dim, block_size, dtype, fused) -> None:
    """Decode rows, draft rows, a lens==1 row and prefill chunks (fresh, cache hit, chunk continuation) of one
    step, through one decode and one prefill launch, equal the reference on every row."""
    case = make_case(MIXED, heads, kv_heads, head_dim, block_size, dtype, seed=heads + head_dim, fused=fused)
    out = new_out(case, fused)
    run_decode(case, out)
    run_prefill(case, out)
    check(case, out)


def test_each_kernel_writes_only_its_rows() -> None:
    """Decode alone touches only the decode rows, prefill alone only the chunks' rows."""
    case = make_case(MIXED, 4, 2, 32, 16, torch.float32, seed=3)
    dec_rows = sorted(case.decode[0].tolist())
    out = new_out(case)
    run_decode(case, out)
    check(case, out, dec_rows)
    out = new_out(case)
    run_prefill(case, out)
    check(case, out, sorted(set(range(out.shape[0])) - set(dec_rows)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_split_kv_equals_unsplit(dtype) -> None:
    """Forced split-KV (3 and 4 splits, some of them empty on short rows) merges to the unsplit result."""
    specs = [("d", 150, 1), ("d", 95, 3), ("d", 0, 1), ("d", 33, 1)]
    case = make_case(specs, 6, 2, 64, 16, dtype, seed=5)
    base = new_out(case)
    run_decode(case, base, num_splits=1)
    check(case, base)
    for splits in (3, 4):
        out = new_out(case)
        run_decode(case, out, num_splits=splits)
        torch.testing.assert_close(out.float(), base.float(), atol=1e-5 if dtype == torch.float32 else 8e-3,
                                   rtol=1e-5 if dtype == torch.float32 else 8e-3)


def test_num_splits_choice() -> None:
    """Few rows over long contexts split; many rows, or short contexts, do not; the auto path is exact."""
    assert choose_num_splits(1, 8, 8192, 132) == 16
    assert choose_num_splits(4, 8, 4096, 132) == 9  # two waves of 132 SMs over 32 programs
    assert choose_num_splits(2, 8, 600, 132) == 2  # >= 256 keys per split
    assert choose_num_splits(64, 8, 8192, 132) == 1  # 512 programs already fill the SMs
    assert choose_num_splits(1, 8, 200, 132) == 1
    case = make_case([("d", 700, 1)], 2, 1, 16, 32, torch.float32, seed=9)
    assert choose_num_splits(1, 1, case.max_len, 132) > 1
    out = new_out(case)
    run_decode(case, out)  # num_splits=None
    check(case, out)


def test_block_size_one_and_long_prefill() -> None:
    """block_size 1 (every key its own block) and a prefill chunk over several query and key tiles."""
    case = make_case([("p", 0, 2 * PREFILL_BLOCK_M + 5), ("d", 9, 2), ("p", 3, 4)], 4, 1, 32, 1,
                     torch.float32, seed=11)
    out = new_out(case)
    run_decode(case, out)
    run_prefill(case, out)
    check(case, out)


def test_prefill_tiles() -> None:
    m = PREFILL_BLOCK_M
    assert prefill_tiles([1, 2 * m + 1, m, 0]) == ([0, 1, 1, 1, 2], [0, 0, m, 2 * m, 0])
    assert prefill_tiles([]) == ([], [])


def test_empty_calls_do_nothing() -> None:
    case = make_case([("p", 0, 3)], 2, 1, 16, 16, torch.float32)
    out = new_out(case)
    run_decode(case, out)  # no decode rows
    assert torch.all(out == SENTINEL)


@pytest.mark.parametrize("bad", ["cache-dtype", "out-dtype", "cache-device", "index-device", "index-int64",
                                 "index-lengths", "gqa", "head-dim", "block-size", "cache-strided", "q-last-dim",
                                 "num-splits", "no-interpreter"])
def test_bad_inputs_raise(bad: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inputs the kernels cannot read are refused with ValueError before any launch, on both entry points
    (decode only where the argument is decode's)."""
    case = make_case([("p", 4, 5), ("d", 7, 1)], 4, 2, 32, 16, torch.float32)
    q, kc, vc, bt = case.q, case.k_cache, case.v_cache, case.block_tables
    out = new_out(case)
    dec, pre = list(case.decode), list(case.prefill)
    splits = None
    if bad == "cache-dtype":
        kc = kc.half()
    elif bad == "out-dtype":
        out = out.double()
    elif bad == "cache-device":
        vc = vc.to("meta")
    elif bad == "index-device":
        dec[1], pre[3], bt = dec[1].to("meta"), pre[3].to("meta"), bt.to("meta")
    elif bad == "index-int64":
        dec[0], pre[0] = dec[0].long(), pre[0].long()
    elif bad == "index-lengths":
        dec[2], pre[4] = torch.cat([dec[2], dec[2]]), torch.cat([pre[4], pre[4]])
    elif bad == "gqa":
        q, out = q[:, :3], out[:, :3]
    elif bad == "head-dim":
        q, out = q[..., :16], out[..., :16]
    elif bad == "block-size":
        kc, vc = kc[:, :12].contiguous(), vc[:, :12].contiguous()
    elif bad == "cache-strided":
        kc = kc.transpose(1, 2).contiguous().transpose(1, 2)
    elif bad == "q-last-dim":
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    elif bad == "num-splits":
        splits = 0
    elif DEVICE.type == "cpu":
        monkeypatch.delenv("TRITON_INTERPRET")
    else:  # on a GPU: a CPU tensor, where the interpreter is off
        q = q.cpu()
    with pytest.raises(ValueError):
        paged_decode_attention(q, kc, vc, out, *dec, bt, case.scale, case.max_len, num_splits=splits)
    if bad != "num-splits":
        with pytest.raises(ValueError):
            paged_prefill_attention(q, kc, vc, out, *pre, bt, case.scale)
    assert out.device.type == "meta" or torch.all(out == SENTINEL), "a refused call wrote to out"
