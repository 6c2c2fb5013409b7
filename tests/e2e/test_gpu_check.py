"""`make gpu-check`'s script in --quick mode on the CPU (Triton in its interpreter), on an engine-only box:
the platform's packages are made unimportable in it and in its pytest subprocesses. Plus its verdicts on
hand-made inputs: a gather inside attention is caught, a divergence is located, steps are selected, step-time
percentiles."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from loraplex.cli.bench import gpu_check_engine, gpu_check_quant, gpu_check_steps
from loraplex.cli.bench.gpu_check import NAMES, CheckContext, parse_junit, select_steps
from loraplex.cli.bench.percentiles import percentile
from loraplex.engine.models import synthetic

REPO = Path(__file__).resolve().parents[2]
# The tenant platform's packages (and the GGUF reader, which synthetic models never touch): absent on a GPU box.
BLOCKED = ("litestar", "sqlalchemy", "redis", "asyncpg", "msgspec", "uvicorn", "httptools", "uvloop", "alembic",
           "aiosqlite", "prometheus_client", "httpx", "gguf")
SITECUSTOMIZE = f'''
import importlib.abc
import sys

BLOCKED = {BLOCKED!r}


class _Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"{{name}} is blocked: not on an engine-only box", name=name)
        return None


sys.meta_path.insert(0, _Blocked())
'''


@pytest.fixture(scope="module")
def engine_only_env(tmp_path_factory) -> dict:
    """PYTHONPATH with a sitecustomize that refuses the platform's packages (every child process inherits it)."""
    site = tmp_path_factory.mktemp("engine-only")
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return dict(os.environ, PYTHONPATH=os.pathsep.join((str(site), str(REPO))), TRITON_INTERPRET="1")


@pytest.fixture(scope="module")
def quick_run(engine_only_env, tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path_factory.mktemp("gpu-check") / "gpu-check.json"
    done = subprocess.run([sys.executable, "-m", "loraplex.cli.bench.gpu_check", "--device", "cpu", "--quick",
                           "--json", str(out)], cwd=REPO, env=engine_only_env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done, json.loads(out.read_text())


def test_the_platform_packages_are_blocked(engine_only_env):
    for name in ("litestar", "sqlalchemy", "redis", "asyncpg", "msgspec"):
        assert importlib.util.find_spec(name) is not None  # installed here: blocking them means something
        done = subprocess.run([sys.executable, "-c", f"import {name}"], env=engine_only_env, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode != 0 and "blocked" in done.stderr


def test_quick_run_passes_every_step_and_reports(quick_run):
    done, report = quick_run
    steps = report["steps"]
    assert list(steps) == NAMES and [s["index"] for s in steps.values()] == list(range(1, len(NAMES) + 1))
    assert report["ok"] and report["complete"] and {s["status"] for s in steps.values()} == {"pass"}, steps
    assert report["args"]["quick"] and report["device"]["type"] == "cpu"
    assert report["versions"]["torch"] == torch.__version__ and steps["versions"]["figures"]["import_errors"] == {}

    k = steps["kernels"]["figures"]  # one test per Triton kernel family, in the interpreter
    assert k["interpreter"] and k["failed"] == 0 and k["unreported"] == 0 and k["passed"] >= 2
    assert k["selected"] == k["passed"] + k["skipped"] and k["collected"] > k["selected"]

    q = steps["quant"]["figures"]  # the W8A16 kernel in the interpreter; FP8 skipped off CUDA, the reason shown
    assert q["int8"]["ok"] and q["int8"]["path"] == "triton-interpreter" and q["tokens"] == [1, 3]
    assert q["int8"]["worst_rel_err"] <= q["max_rel_err"]["int8"] and q["int8"]["m3"]["us"] > 0
    assert "CUDA only" in q["fp8"]["skipped"] and "fp8 skipped: FP8 GEMMs run on CUDA only" in steps["quant"]["summary"]

    p = steps["parity"]["figures"]
    assert p["cpu_fp32_vs_device_fp32"]["identical"] and p["cpu_fp32_vs_device_fp32"]["requests"] == 3
    assert "first_divergence" in p["device_bf16_vs_device_fp32"]
    b = steps["batch_invariance"]["figures"]
    assert b["batch"] == 16 and b["batch_vs_alone"]["identical"]
    lo = steps["lora_parity"]["figures"]
    assert lo["adapters"] == 8 and lo["cpu_vs_device"]["identical"] and lo["adapter_requests_unlike_base"] > 0

    prof = steps["profile"]["figures"]["tiny"]  # the Triton paged kernels, traced: K/V read in place
    assert prof["attention_backend"] == "triton_paged" and prof["decode_rows"] == 4
    assert prof["attention_ranges"] == prof["layers"] and prof["gathers_in_attention"] == []

    t = steps["throughput"]["figures"]
    assert t["roofline"]["mem_read_gbs"] > 0 and t["roofline"]["gemm_gflops"] > 0
    for key in ("batch1", "batch4"):
        assert t["tiny"][key]["ours_tok_s"] > 0 and t["tiny"][key]["hf_tok_s"] > 0
    lt = steps["lora_throughput"]["figures"]
    assert min(lt["base_tok_s"], lt["identical_tok_s"], lt["distinct_tok_s"]) > 0 and lt["adapters"] == 8

    g = steps["graphs"]["figures"]  # the static decode step, eager on the CPU, against the dynamic one
    assert g["static_decode"] == {"off": None, "on": "eager", "on_sync": "eager"}
    assert g["attention_backend"] == "triton_paged"
    for key in ("batch1", "batch2"):
        assert g[key]["on_vs_off_tokens"]["identical"] and g[key]["on_vs_off_tokens"]["tokens_per_request"] > 2
        assert g[key]["async_vs_sync_tokens"]["identical"] and g[key]["graphs_on_sync"]["median_ms"] > 0
        assert g[key]["graphs_on"]["median_ms"] > 0 and g[key]["graphs_off"]["steps"] == g["timed_steps"]
    assert "target" not in g  # (judged on CUDA only)
    s = steps["sampled"]["figures"]
    assert s["batch"] == 8 and len(s["seeded"]) == 2 and s["seeded_batch_vs_alone"]["identical"]
    assert s["sampled_unlike_greedy"] > 0 and min(s["greedy_tok_s"], s["sampled_tok_s"]) > 0
    a = steps["adapter_load"]["figures"]  # the unread adapter read once, in the background
    assert a["decoding"] == 32 and a["adapter_read_from_disk"] == 1 and a["window_steps"] >= 1
    assert len(a["window_ms"]["load"]) == len(a["window_ms"]["without"]) == a["window_steps"]
    assert min(a["p99_ms_during_load"], a["p99_ms_without"]) > 0 and "target" not in a
    m = steps["memory"]["figures"]["tiny"]  # the CPU: the configured 512 MiB, nothing measured
    assert 500 * 2**20 < m["kv_cache_bytes"] <= 512 * 2**20 and m["kv_blocks"] * 16 == m["kv_tokens"]
    assert m["memory_budget_bytes"] == 0 and m["peak_step_bytes"] == 0 and m["max_step"]["prompt_tokens"] == 2047

    table = done.stdout[done.stdout.index("gpu-check summary"):]
    assert all(f" {name} " in table for name in NAMES) and "overall: OK" in table


def test_a_gather_inside_attention_is_caught():
    """torch_sdpa gathers each decode's K/V blocks with index_select: the profile step must see it."""
    ctx = CheckContext(device=torch.device("cpu"), quick=True, new_tokens=4, rounds=1,
                       deadline=time.monotonic() + 120, work_dir=Path(tempfile.mkdtemp()))
    f = gpu_check_steps.profile_decode(ctx, "tiny", backend="torch_sdpa")
    assert f["attention_ranges"] == 2 and "aten::index_select" in f["gathers_in_attention"]


def test_quant_step_checks_the_int8_kernel_and_skips_fp8_with_its_reason():
    """The quant step on the CPU (Triton in the interpreter): the int8 GEMM within its bound of the reference,
    its weight in half bf16's bytes plus scales, timed against bf16 at each token count; FP8 skipped, saying why."""
    ctx = CheckContext(device=torch.device("cpu"), quick=True, new_tokens=4, rounds=1,
                       deadline=time.monotonic() + 120, work_dir=Path(tempfile.mkdtemp()))
    status, summary, f = gpu_check_quant.quant(ctx)
    assert status == "pass" and f["weight"] == [96, 64]
    assert f["fp8"] == {"skipped": "FP8 GEMMs run on CUDA only, not on cpu"}
    i8 = f["int8"]
    assert i8["ok"] and 0 < i8["worst_rel_err"] <= 1e-2 and i8["weight_bytes"] == 96 * 64 + 96 * 4
    assert i8["bf16_weight_bytes"] == 96 * 64 * 2 and 0 < i8["weight_max_abs_err"] < 0.01
    for m in (1, 3):
        assert i8[f"m{m}"]["us"] > 0 and i8[f"m{m}"]["bf16_us"] > 0 and i8[f"m{m}"]["speedup_vs_bf16"] > 0
    assert summary.startswith("int8 (triton-interpreter) err ") and "fp8 skipped: FP8 GEMMs run on CUDA only" in summary


def test_profile_analysis_of_device_events():
    """The CUDA side, on hand-made profiler events: kernels counted (copies apart), busy time as the union of
    device intervals, kernels inside the attention range's device span or linked to it, and its gathers."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    def ev(i, name, start, end, device=DeviceType.CPU, **kw):
        return FunctionEvent(i, name, thread=0, start_us=start, end_us=end, device_type=device, **kw)

    attn, select = ev(1, gpu_check_steps.ATTN_RANGE, 0, 50), ev(2, "aten::index_select", 10, 20)
    mm = ev(3, "aten::mm", 60, 70)
    attn.append_cpu_child(select)
    attn.append_kernel("linked_attention_kernel", 0, 5.0)
    cuda = DeviceType.CUDA
    events = [attn, select, mm,
              ev(10, gpu_check_steps.ATTN_RANGE, 100, 200, cuda, is_user_annotation=True),  # the range on the GPU
              ev(11, "_paged_decode_kernel", 110, 150, cuda), ev(12, "indexSelectLargeIndex", 150, 160, cuda),
              ev(13, "sm90_bf16_gemm", 300, 400, cuda), ev(14, "sm90_bf16_gemm", 350, 420, cuda),
              ev(15, "Memcpy HtoD (Pinned -> Device)", 90, 95, cuda)]
    f = gpu_check_steps.analyse_profile(events, wall_s=0.001)
    assert (f["kernels"], f["memcpy_memset"], f["attention_ranges"], f["cpu_ops"]) == (4, 1, 1, 3)
    assert f["device_busy_ms"] == 0.175 and f["device_busy_fraction"] == 0.175  # 5 + 40 + 10 + 120 us of 1 ms
    assert f["attention_kernels"] == ["_paged_decode_kernel", "indexSelectLargeIndex", "linked_attention_kernel"]
    assert f["gathers_in_attention"] == ["aten::index_select", "indexSelectLargeIndex"]
    assert f["top_kernels_us"]["sm90_bf16_gemm"] == 170.0


def test_percentiles_of_step_times():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert percentile([float(i) for i in range(101)], 99) == 99.0
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    f = gpu_check_engine.ms_stats([1.0, 2.0, 10.0])
    assert (f["steps"], f["median_ms"], f["min_ms"], f["max_ms"]) == (3, 2.0, 1.0, 10.0) and f["p99_ms"] == 9.84


def test_junit_outcomes(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text('<testsuites><testsuite><testcase classname="tests.kernels.test_x" name="test_ok"/>'
                   '<testcase classname="tests.kernels.test_x" name="test_bad[a]"><failure message="x"/></testcase>'
                   '<testcase classname="tests.kernels.test_x" name="test_crash"><error message="y"/></testcase>'
                   '<testcase classname="tests.kernels.test_y" name="test_cpu"><skipped message="z"/></testcase>'
                   '</testsuite></testsuites>')
    assert parse_junit(xml) == {"passed": ["test_x::test_ok"], "failed": ["test_x::test_bad[a]", "test_x::test_crash"],
                                "skipped": ["test_y::test_cpu"]}


def test_compare_locates_the_first_divergence():
    c = gpu_check_steps.compare([[1, 2, 3], [4, 5, 6], [7, 8]], [[1, 2, 3], [4, 9, 6], [7, 8, 0]])
    assert not c["identical"] and c["diverged_requests"] == 2
    assert c["first_divergence"] == {"request": 1, "position": 1, "got": 5, "want": 9}
    assert c["divergences"][1] == {"request": 2, "position": 2, "got": None, "want": 0}
    assert gpu_check_steps.compare([[1]], [[1]])["first_divergence"] is None


def test_steps_are_chosen_by_name_or_number():
    assert select_steps("1,kernels", None) == {"versions", "kernels"}
    assert select_steps(None, "throughput,9") == set(NAMES) - {"throughput", "lora_throughput"}
    with pytest.raises(SystemExit, match="unknown step 'nine'"):
        select_steps("nine", None)


def test_synthetic_llama3_8b_shapes_and_device_weights():
    """The 8B preset has Llama-3-8B's shapes; off the CPU each tensor is drawn where it lives, in its dtype, from
    its own seeded generator (the device path, run here on the CPU), while the CPU path keeps its values."""
    c = synthetic.PRESETS["llama3-8b"]
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads,
            c.head_dim, c.rope_theta, c.max_position_embeddings, c.tie_word_embeddings) == \
        (128256, 4096, 14336, 32, 32, 8, 128, 500000.0, 8192, False)
    assert round(c.num_params() / 1e9, 2) == 8.03
    tiny = synthetic.PRESETS["tiny"]
    a = synthetic._device_weights(tiny, 5, torch.device("cpu"), torch.bfloat16)
    b = synthetic._device_weights(tiny, 5, torch.device("cpu"), torch.bfloat16)
    other = synthetic._device_weights(tiny, 6, torch.device("cpu"), torch.bfloat16)
    assert all(torch.equal(a[k], b[k]) and a[k].dtype == torch.bfloat16 for k in a)
    assert not torch.equal(a["embed"], other["embed"])
    assert torch.equal(a["norm"], torch.ones(tiny.hidden_size, dtype=torch.bfloat16))
    assert 0.015 < a["layers.0.gate_up"].float().std().item() < 0.025
    _, fp32, _ = synthetic.synthetic_model("tiny", 5)
    _, bf16, _ = synthetic.synthetic_model("tiny", 5, device="cpu", dtype=torch.bfloat16)
    assert all(torch.equal(fp32[k].bfloat16(), bf16[k]) for k in fp32)

