"""The C kernels for CPU serving (kernels/cpu) against plain torch, and the build that makes them.

The build must succeed on a machine with a C compiler (this one and CI): a failed build fails
these tests instead of skipping them.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from loraplex.engine.kernels.cpu import build
from loraplex.engine.kernels.cpu.layer_ops import add_rms_norm, decode_attention, rope_, silu_mul
from loraplex.engine.kernels.cpu.linear import pack, packed_linear
from loraplex.engine.models.layer_ops import CpuKernelOps, TorchOps, ops_for


def test_kernels_build_and_load(tmp_path, monkeypatch):
    """A build from nothing into an empty cache, then a cache hit. At -O0 (half the compile time): the -O3 build
    the suite runs on is the default cache's, compiled whenever a source, a flag or the compiler changes."""
    monkeypatch.setenv("LORAPLEX_CPU_CFLAGS", f"{os.environ.get('LORAPLEX_CPU_CFLAGS', '')} -O0")
    path = build.build(tmp_path)
    assert path.exists() and path.parent == tmp_path / "kernels"
    assert build.build(tmp_path) == path  # cached: same key, no rebuild
    monkeypatch.undo()
    assert build.library() is not None
    assert isinstance(ops_for(torch.zeros(8, 4), torch.zeros(8, 4)), CpuKernelOps)


def test_processes_starting_together_build_the_kernels_once(tmp_path):
    """Two processes asking for the same build into an empty cache at once: one compiles (its link is the only
    one the compiler wrapper logs) and both load the same library."""
    log, cc = tmp_path / "cc.log", tmp_path / "cc"
    cc.write_text(f'#!/bin/sh\necho "$*" >> {log}\nexec {shutil.which("cc")} "$@"\n')
    cc.chmod(0o755)
    env = dict(os.environ, CC=str(cc), LORAPLEX_CPU_CFLAGS=f"{os.environ.get('LORAPLEX_CPU_CFLAGS', '')} -O0")
    code = ("from pathlib import Path; from loraplex.engine.kernels.cpu import build; "
            f"print(build.build(Path({str(tmp_path)!r})))")
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    paths = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs) and paths[0] == paths[1] and os.path.exists(paths[0])
    links = [line for line in log.read_text().splitlines() if " -c " not in f" {line} " and "--version" not in line]
    assert len(links) == 1, links


def test_kernels_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("LORAPLEX_CPU_KERNELS", "0")
    build.library.cache_clear()
    try:
        assert build.library() is None
    finally:
        monkeypatch.delenv("LORAPLEX_CPU_KERNELS")
        build.library.cache_clear()
    assert build.library() is not None


@pytest.mark.parametrize("m", [0, 1, 2, 3, 4, 5, 31, 64, 65, 130])
@pytest.mark.parametrize("n,k", [(1, 1), (7, 13), (24, 576), (1001, 577), (257, 1536)])
def test_packed_linear_matches_f_linear(m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    pw = pack(w)
    torch.testing.assert_close(packed_linear(x, pw), F.linear(x, w), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(packed_linear(x, pw, b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def test_packed_kernel_blocks_rows_beyond_its_dispatch_limit(monkeypatch):
    from loraplex.engine.kernels.cpu import linear

    monkeypatch.setattr(linear, "PACKED_MAX_ROWS", 10**6)  # C's 64-row blocks, not MKL
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(200, 96, generator=g), torch.randn(50, 96, generator=g), torch.randn(50, generator=g)
    torch.testing.assert_close(packed_linear(x, pack(w), b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("m", [5, 6, 7, 8, 9, 63, 64, 65, 131])
def test_packed_kernel_prefetch_and_thread_edges(m, monkeypatch):
    """Big enough for the threads to split the panels, where groups of 4 rows prefetch each thread's
    next panel: row tails, several 64-row blocks, a partial last panel, strided rows and bias."""
    from loraplex.engine.kernels.cpu import linear

    monkeypatch.setattr(linear, "PACKED_MAX_ROWS", 10**6)
    g = torch.Generator().manual_seed(m)
    n, k = 24 * 45 + 7, 301
    rows, w, b = torch.randn(m, k + 5, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    x = rows[:, 2 : 2 + k]
    pw = pack(w)
    want = F.linear(x.double(), w.double(), b.double()).float()
    torch.testing.assert_close(packed_linear(x, pw, b), want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(packed_linear(x, pw), want - b, rtol=1e-5, atol=1e-4)


def test_packed_linear_runs_from_several_threads_at_once():
    from concurrent.futures import ThreadPoolExecutor

    g = torch.Generator().manual_seed(2)
    w, b = torch.randn(1000, 200, generator=g), torch.randn(1000, generator=g)
    xs = [torch.randn(m, 200, generator=g) for m in (1, 4, 9, 32, 33, 64) * 3]
    pw = pack(w)
    with ThreadPoolExecutor(4) as pool:
        ys = list(pool.map(lambda x: packed_linear(x, pw, b), xs))
    for x, y in zip(xs, ys, strict=True):
        torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def test_packed_linear_takes_row_views():
    g = torch.Generator().manual_seed(0)
    rows, w = torch.randn(6, 100, generator=g), torch.randn(30, 64, generator=g)
    x = rows[:, 10:74]  # strided rows, dense features
    torch.testing.assert_close(packed_linear(x, pack(w)), F.linear(x, w), rtol=1e-5, atol=1e-4)
    xt = torch.randn(64, 6, generator=g).t()  # features not dense: copied first
    torch.testing.assert_close(packed_linear(xt, pack(w)), F.linear(xt, w), rtol=1e-5, atol=1e-4)


def test_packed_linear_refuses_bad_input():
    pw = pack(torch.randn(8, 4))
    with pytest.raises(ValueError, match="expects 4"):
        packed_linear(torch.randn(1, 3), pw)
    with pytest.raises(ValueError, match="float32"):
        packed_linear(torch.randn(1, 4, dtype=torch.float64), pw)
    with pytest.raises(ValueError, match="bias has 3"):
        packed_linear(torch.randn(1, 4), pw, torch.randn(3))
    with pytest.raises(ValueError, match="contiguous"):
        pack(torch.randn(4, 8).t())


@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_add_rms_norm_matches_torch(tokens):
    g = torch.Generator().manual_seed(tokens)
    h, d = torch.randn(tokens, 576, generator=g), torch.randn(tokens, 576, generator=g)
    w = torch.randn(576, generator=g)
    ref_h, ref_x = TorchOps(torch.zeros(1, 2), torch.zeros(1, 2)).add_rms_norm(h.clone(), d, w, 1e-5)
    x = add_rms_norm(h, d, w, 1e-5)  # h updated in place
    torch.testing.assert_close(h, ref_h)
    torch.testing.assert_close(x, ref_x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(add_rms_norm(h.clone(), None, w, 1e-5), ref_x, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="delta has shape"):
        add_rms_norm(h, d[:, :5].contiguous(), w, 1e-5)


def test_rope_matches_torch():
    g = torch.Generator().manual_seed(3)
    max_pos, head_dim, n_heads, n_kv = 64, 16, 4, 2
    ang = torch.outer(torch.arange(max_pos, dtype=torch.float64), torch.rand(head_dim // 2, generator=g).double())
    ang = torch.cat((ang, ang), -1)
    cos, sin = ang.cos().float(), ang.sin().float()
    qkv = torch.randn(5, (n_heads + 2 * n_kv) * head_dim, generator=g)
    pos = torch.tensor([0, 7, 63, 2, 2])
    ref_ops = TorchOps(cos, sin)
    q_ref, k_ref = ref_ops.rope_qk(qkv.clone(), ref_ops.rope_state(pos), n_heads, n_kv, head_dim)
    ops = CpuKernelOps(cos, sin)
    v_before = qkv[:, (n_heads + n_kv) * head_dim:].clone()
    q, k = ops.rope_qk(qkv, ops.rope_state(pos), n_heads, n_kv, head_dim)
    torch.testing.assert_close(q, q_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(k, k_ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(qkv[:, (n_heads + n_kv) * head_dim:], v_before)  # v is not rotated
    with pytest.raises(ValueError, match="positions must lie"):
        ops.rope_state(torch.tensor([0, 64]))
    with pytest.raises(ValueError, match="positions for"):
        rope_(qkv, n_heads, head_dim, pos[:2], cos, sin)


def _paged(seqs_k, seqs_v, block_size, num_blocks, g):
    """Scatters each sequence's K/V [len, kv, d] into shuffled blocks; returns caches and tables.
    num_blocks None: just enough blocks, plus two left unused."""
    kv, d = seqs_k[0].shape[1:]
    need = [math.ceil(ks.shape[0] / block_size) for ks in seqs_k]
    num_blocks = sum(need) + 2 if num_blocks is None else num_blocks
    k_cache = torch.full((num_blocks, block_size, kv, d), float("nan"))  # unused slots must never be read
    v_cache = k_cache.clone()
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = []
    for ks, vs, n_blocks in zip(seqs_k, seqs_v, need, strict=True):
        blocks = [free.pop() for _ in range(n_blocks)]
        j = torch.arange(ks.shape[0])
        slots = torch.tensor(blocks)[j // block_size] * block_size + j % block_size
        k_cache.view(-1, kv, d)[slots] = ks
        v_cache.view(-1, kv, d)[slots] = vs
        tables.append(blocks)
    width = max(len(t) for t in tables) + 1  # padding column, as the engine's tables have
    return k_cache, v_cache, torch.tensor([t + [0] * (width - len(t)) for t in tables])


@pytest.mark.parametrize("q_scale", [1.0, 30.0])  # 30: peaked softmax, most weights underflow
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1)])
def test_decode_attention_matches_sdpa(heads, kv_heads, q_scale):
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    d, bs, lens = 64, 16, [1, 17, 100, 33]
    ks = [torch.randn(n, kv_heads, d, generator=g) for n in lens]
    vs = [torch.randn(n, kv_heads, d, generator=g) for n in lens]
    k_cache, v_cache, tables = _paged(ks, vs, bs, 32, g)
    q_rows = torch.randn(len(lens), heads * d + 40, generator=g) * q_scale  # strided rows, like views into qkv
    q = q_rows[:, :heads * d].view(len(lens), heads, d)
    out = decode_attention(q, k_cache, v_cache, tables, torch.tensor(lens), max(lens), 1 / math.sqrt(d))
    for b in range(len(lens)):
        ref = F.scaled_dot_product_attention(q[b].unsqueeze(1), ks[b].transpose(0, 1), vs[b].transpose(0, 1),
                                             enable_gqa=heads != kv_heads)  # [heads, 1, d]
        torch.testing.assert_close(out[b], ref.squeeze(1), rtol=1e-5, atol=1e-5)


@pytest.fixture(params=[1, 3], ids=["1thread", "3threads"])
def attention_threads(request):
    """The kernels' OpenMP team size (torch shares their runtime): 3 makes the kernel cut contexts
    between threads and merge the partial softmaxes, a sequence even spanning all three."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _check_decode_attention(heads, kv_heads, d, bs, lens, g, q_scale=1.0):
    """decode_attention over a fresh paged cache against float64 SDPA per sequence."""
    ks = [torch.randn(n, kv_heads, d, generator=g) for n in lens]
    vs = [torch.randn(n, kv_heads, d, generator=g) for n in lens]
    k_cache, v_cache, tables = _paged(ks, vs, bs, None, g)
    q = torch.randn(len(lens), heads, d, generator=g) * q_scale
    out = decode_attention(q, k_cache, v_cache, tables, torch.tensor(lens), max(lens), 1 / math.sqrt(d))
    for b in range(len(lens)):
        ref = F.scaled_dot_product_attention(q[b].unsqueeze(1).double(), ks[b].transpose(0, 1).double(),
                                             vs[b].transpose(0, 1).double(), enable_gqa=heads != kv_heads)
        torch.testing.assert_close(out[b], ref.squeeze(1).float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lens", [[1500], [5000], [5000, 7, 300], [129] * 10], ids=["b1-1500", "b1-5000", "mixed",
                                                                                     "b10"])
def test_decode_attention_long_contexts(lens, attention_threads):
    _check_decode_attention(9, 3, 64, 16, lens, torch.Generator().manual_seed(len(lens) + lens[0]))


@pytest.mark.parametrize("d", [128, 80, 36])  # 80: not a multiple of 64 (the kernel's register block); 36: of 8
@pytest.mark.parametrize("heads,kv_heads,bs", [(8, 2, 16), (6, 6, 5)])
def test_decode_attention_head_dims_and_block_sizes(d, heads, kv_heads, bs, attention_threads):
    _check_decode_attention(heads, kv_heads, d, bs, [1, 9, 70, 400], torch.Generator().manual_seed(d + bs))


def test_decode_attention_many_heads_and_empty_context(attention_threads):
    """More query heads than the kernel takes at once (it makes passes), and a zero-length context,
    which gives zeros."""
    g = torch.Generator().manual_seed(5)
    _check_decode_attention(40, 1, 64, 16, [300, 1], g)
    k_cache = torch.randn(4, 16, 2, 32, generator=g)
    q = torch.randn(2, 4, 32, generator=g)
    out = decode_attention(q, k_cache, k_cache, torch.tensor([[0, 1], [2, 3]]), torch.tensor([0, 20]), 20, 0.2)
    assert torch.equal(out[0], torch.zeros(4, 32))
    assert out[1].isfinite().all()


def test_decode_attention_refuses_mismatched_input():
    k_cache = torch.zeros(4, 16, 3, 64)
    q = torch.zeros(2, 9, 64)
    tables, lens = torch.zeros(2, 2, dtype=torch.long), torch.tensor([3, 5])
    with pytest.raises(ValueError, match="do not match"):
        decode_attention(q, k_cache, torch.zeros(4, 16, 3, 32), tables, lens, 5, 0.1)
    with pytest.raises(ValueError, match="exceeds 2 blocks"):
        decode_attention(q, k_cache, k_cache, tables, lens, 33, 0.1)
    with pytest.raises(ValueError, match="int64"):
        decode_attention(q, k_cache, k_cache, tables.int(), lens, 5, 0.1)


@pytest.mark.parametrize("model", ["synthetic:tiny", "synthetic:tiny-bias"])
def test_engine_gives_the_same_tokens_with_kernels_and_torch_ops(model, monkeypatch):
    """A mixed batch (chunked prefills beside decodes, GQA; q/k/v bias) through both op sets."""
    from loraplex.engine.api import GenerateRequest, SamplingParams
    from loraplex.engine.models import llama
    from tests.conftest import make_core

    def run(use_kernels: bool) -> list[list[int]]:
        if not use_kernels:
            monkeypatch.setattr(llama, "ops_for", lambda cos, sin, *args, **kwargs: TorchOps(cos, sin))
        core = make_core(model, max_num_batched_tokens=24, max_num_seqs=6)
        assert isinstance(core.runner.model.ops, CpuKernelOps) == use_kernels
        sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        reqs = [GenerateRequest(f"r{i}", model, prompt_token_ids=tuple(range(5, 5 + 3 + 7 * i)), sampling=sp)
                for i in range(6)]
        return [c.token_ids for c in core.run(reqs)]

    assert run(True) == run(False)


@pytest.mark.parametrize("tokens,inter", [(1, 1536), (3, 13), (40, 64)])
def test_silu_mul_matches_torch(tokens, inter):
    g = torch.Generator().manual_seed(inter)
    gate_up = torch.randn(tokens, 2 * inter, generator=g) * 8  # wide range: exp's tails are used
    gate_up[0, :3] = torch.tensor([-200.0, 200.0, 0.0])
    ref = TorchOps(torch.zeros(1, 2), torch.zeros(1, 2)).silu_mul(gate_up)
    torch.testing.assert_close(silu_mul(gate_up), ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="even width"):
        silu_mul(torch.zeros(2, 5))
