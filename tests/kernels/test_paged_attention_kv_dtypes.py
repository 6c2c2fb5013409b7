"""The Triton paged-attention kernels over KV caches of 16- and 8-bit types (kv/kv_dtype.py; on the CPU under
TRITON_INTERPRET=1): a mixed batch of decode rows, drafts and prefill chunks equals the reference over the
cache's dequantized values, and stays within the type's rounding of the fp32 cache's output."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine.kernels.paged_attention import paged_decode_attention
from loraplex.engine.kernels.paged_attention_ref import paged_attention_ref
from loraplex.engine.kv import kv_dtype
from tests.kernels.test_paged_attention import MIXED, TOL, make_case, new_out, run_decode, run_prefill

# output against the fp32 cache's, |error| bound per cache type (values ~N(0, 1))
ATOL = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.int8: 3e-2, torch.float8_e4m3fn: 1.2e-1}


def _as(case, dtype: torch.dtype):
    """The case with its caches written in `dtype` (NaN slots stay poison: an 8-bit row's scale is NaN), and the
    values those caches hold, as fp32 caches for the reference."""
    head_dim = case.q.shape[2]
    k, v = (kv_dtype.quantize(c, dtype) for c in (case.k_cache, case.v_cache))
    seen = [kv_dtype.dequantize(c, head_dim, torch.float32) for c in (k, v)]
    return type(case)(**{**case.__dict__, "k_cache": k, "v_cache": v}), seen


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int8, torch.float8_e4m3fn],
                         ids=["bf16", "f16", "int8", "fp8"])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=["q-f32", "q-bf16"])
def test_mixed_batch_over_each_cache_type_matches_the_reference(dtype, q_dtype):
    base = make_case(MIXED, 8, 2, 32, 16, torch.float32, seed=3)
    case, (k_seen, v_seen) = _as(base, dtype)
    case.q = base.q.to(q_dtype)
    out = new_out(case)
    run_decode(case, out)
    run_prefill(case, out)
    rows = [r for r0, n, _, _ in case.ref_seqs for r in range(r0, r0 + n)]
    want = paged_attention_ref(case.q.float(), k_seen, v_seen, case.ref_seqs, case.scale)
    rtol, atol = TOL[q_dtype]
    torch.testing.assert_close(out[rows].float(), want[rows], rtol=rtol, atol=atol)
    exact = paged_attention_ref(base.q, base.k_cache, base.v_cache, base.ref_seqs, base.scale)
    err = (out[rows].float() - exact[rows]).abs().max().item()
    assert err <= ATOL[dtype] + (atol if q_dtype != torch.float32 else 0), err


def test_split_kv_over_an_fp8_cache_equals_unsplit():
    base = make_case([("d", 300, 1), ("d", 90, 2)], 4, 1, 64, 16, torch.float32, seed=5)
    case, _ = _as(base, torch.float8_e4m3fn)
    outs = []
    for splits in (1, 4):
        out = new_out(case)
        run_decode(case, out, num_splits=splits)
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    check_rows = [r for r0, n, _, _ in case.ref_seqs for r in range(r0, r0 + n)]
    assert torch.isfinite(outs[0][check_rows]).all()


def test_a_cache_without_room_for_the_scales_is_refused():
    case = make_case([("d", 7, 1)], 4, 2, 32, 16, torch.float32)
    k = case.k_cache.to(torch.int8)  # [.., 32]: an int8 row of 32 needs 36
    with pytest.raises(ValueError, match="rows of 32 in the torch.int8 cache"):
        paged_decode_attention(case.q, k, k, new_out(case), *case.decode, case.block_tables, case.scale, case.max_len)

