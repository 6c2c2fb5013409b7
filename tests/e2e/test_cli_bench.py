"""`loraplex bench ...` runs end to end and writes the JSON keys the issues name (tiny settings)."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from loraplex.cli.bench.engine import BenchTarget
from loraplex.cli.bench.kernels import run_kernels_bench
from loraplex.cli.bench.soak_hostile import hostile_requests
from loraplex.engine.kernels.cpu.linear import panel_columns
from tests.conftest import one_ray_cluster
from tests.e2e.server import PG_SERVER
from tests.e2e.test_cli_generate import loraplex


def run_bench(tmp_path, *args: str) -> dict:
    out = tmp_path / "result.json"
    done = loraplex("bench", *args, "--json", str(out))
    assert done.returncode == 0, done.stderr
    return json.loads(out.read_text())


def test_bench_engine_reports_ours_and_roofline(tmp_path):
    r = run_bench(tmp_path, "engine", "--model", "synthetic:tiny", "--skip-hf", "--batch", "4",
                  "--batch1-prompts", "1", "--new-tokens", "4", "--rounds", "2", "--device", "cpu",
                  "--attention-backend", "torch_sdpa")
    machine = r["machine"]  # where it ran: --dtype auto is fp32 on the CPU
    assert (machine["device"], machine["dtype"], r["dtype"]) == ("cpu", "float32", "float32")
    assert machine["attention_backend"] == machine["attention_backend_used"] == "torch_sdpa" and machine["device_name"]
    assert machine["torch"] == torch.__version__ and machine["triton"]
    assert r["roofline"]["mem_read_gbs"] > 0 and r["roofline"]["gemm_gflops"] > 0
    for key in ("batch1", "batch4"):
        assert r[key]["ours_tok_s"] > 0 and r[key]["roofline_tok_s"] > 0
        assert len(r["rounds"][f"{key}.ours"]) == 2 and r[key]["ours_tok_s"] == max(r["rounds"][f"{key}.ours"])


def test_bench_targets_refuse_an_unknown_device_dtype_or_backend_before_loading():
    """(The CLI prints such a ValueError as one line, `loraplex: error: ...`, like every option error.)"""
    for kwargs, says in [({"device": "tpu"}, "--device must be auto, cpu, cuda or cuda:N, got 'tpu'"),
                         ({"dtype": "int4"}, "int4"), ({"attention_backend": "flash"}, "attention_backend")]:
        with pytest.raises(ValueError, match=re.escape(says)):
            BenchTarget.parse(**kwargs)


def test_bench_kernels_quick_runs_every_kernel_in_the_interpreter():
    """In process (the test session runs Triton in its interpreter); the CLI around it is bench_cmd's."""
    r = run_kernels_bench(device="cpu", quick=True)
    assert (r["device"], r["dtype"], r["quick"]) == ("cpu", "float32", True) and "interpreter" in r["note"]
    assert r["machine"]["triton"] and r["roofline"]["mem_read_gbs"] > 0
    assert set(r["lora"]) == {"bgmv_decode", "sgmv_prefill"}
    assert set(r["attention"]) == {"prefill", *(f"decode_ctx{ctx}" for ctx in r["shapes"]["contexts"])}
    for case in [*r["lora"].values(), *r["attention"].values()]:  # fp32: both paths match the references
        assert case["max_abs_err_triton"] < 1e-4 and case["max_abs_err_torch"] < 1e-4, case
        assert case["triton_us"] > 0 and case["torch_us"] > 0 and case["triton_speedup"] > 0
    shapes = r["shapes"]
    decode = r["attention"][f"decode_ctx{shapes['contexts'][0]}"]  # K and V of every row's context, 4-byte fp32
    assert decode["kv_bytes"] == 2 * shapes["batch"] * decode["context"] * shapes["kv_heads"] * shapes["head_dim"] * 4
    assert decode["fraction_of_read_bandwidth"] == round(decode["triton_gbs"] / r["roofline"]["mem_read_gbs"], 3)


def test_bench_prefix_and_priority_compare_both_sides(tmp_path):
    r = run_bench(tmp_path, "prefix", "--model", "synthetic:tiny", "--requests", "4", "--system-tokens", "64",
                  "--question-tokens", "8", "--choices", "4", "--choice-prompt-tokens", "72")
    assert set(r["ttft_ms"]) == {"uncached_p50", "cached_p50"}
    assert r["cached_prompt_tokens_total"]["cached"] > 0 == r["cached_prompt_tokens_total"]["uncached"]
    # 4 choices of a 72-token prompt at once: with the cache, its 4 full blocks are computed and held once
    burst = r["choices_at_once"]
    assert burst["uncached"]["prompt_tokens_computed"] == 4 * 72
    assert burst["cached"]["prompt_tokens_computed"] == 72 + 3 * 8
    assert burst["cached"]["peak_kv_blocks"] == burst["uncached"]["peak_kv_blocks"] - 3 * 4
    r = run_bench(tmp_path, "priority", "--model", "synthetic:tiny", "--max-num-seqs", "2", "--batch-tokens", "8",
                  "--realtime-requests", "2", "--interval", "0.05")
    assert {"with_priority_p99", "fcfs_p99"} <= set(r["realtime_ttft_ms"])


def test_bench_lora_reports_every_pattern_peft_and_both_loads(tmp_path):
    r = run_bench(tmp_path, "lora", "--model", "synthetic:tiny", "--batch", "4", "--new-tokens", "2", "--rounds", "1")
    assert (r["machine"]["device"], r["dtype"], r["machine"]["attention_backend"]) == ("cpu", "float32", "auto")
    assert [r[k]["distinct_adapters"] for k in ("identical", "distinct")] == [1, 4]
    assert 1 <= r["zipf"]["distinct_adapters"] <= 4
    assert r["zipf_rank64_fleet"]["distinct_adapters"] == r["zipf"]["distinct_adapters"]
    assert r["zipf_rank64_fleet"]["buffer_rank"] == 64  # the fleet's rank-64 adapter grew its slot buffers
    for key, of in (("zipf_bf16_slots", "zipf"), ("distinct_bf16_slots", "distinct")):  # the fp32 model's batches
        assert r[key]["slot_dtype"] == "bfloat16" and r[key]["distinct_adapters"] == r[of]["distinct_adapters"]
        assert 0 <= r[key]["requests_as_fp32"] <= r[key]["requests"] == 4
        assert 0 <= r[key]["tokens_before_difference"] <= 1
    for key in ("identical", "zipf", "distinct", "zipf_rank64_fleet", "zipf_bf16_slots", "distinct_bf16_slots"):
        assert r[key]["tok_s"] > 0 and len(r["rounds"][key]) == 1
        assert r["ratios"][f"{key}_vs_base"] == round(r[key]["tok_s"] / r["base_tok_s"], 3)
    assert r["peft_distinct"]["tok_s"] > 0 and "distinct_vs_peft" in r["paired_ratios"]
    assert r["ratios"]["distinct_bf16_slots_vs_peft"] == round(r["distinct_bf16_slots"]["tok_s"]
                                                               / r["peft_distinct"]["tok_s"], 2)
    assert r["adapter_load_ms"] > 0 and r["adapter_load_cached_ms"] > 0  # from disk, from the page cache
    assert r["adapter_slot_swap_ms"] > 0  # from the CPU tier into a device slot


def test_bench_gateway_measures_auto_beside_the_named_model(tmp_path):
    r = run_bench(tmp_path, "gateway", "--database-url", "sqlite", "--redis-url", "none", "--rate", "50",
                  "--seconds", "1", "--concurrency", "4", "--auto")
    for result in (r, r["auto"]):  # every request answered 200: `auto` found its pool and routed
        assert result["failures"] == {"gateway": 0, "direct": 0, "max_rps": 0}
        assert result["requests"] == 50 and result["max_rps"] > 0
    assert set(r["auto_vs_named"]["added_latency_ms_diff"]) == {"p50", "p90", "p99"}
    assert r["auto_vs_named"]["max_rps_ratio"] == round(r["auto"]["max_rps"] / r["max_rps"], 3)


def test_bench_speculative_compares_both_engines_on_the_same_tokens(tmp_path):
    r = run_bench(tmp_path, "speculative", "--model", "synthetic:tiny", "--new-tokens", "12", "--rounds", "1")
    sections = [k for k in r if k.startswith(("quote_", "free_"))]
    assert sorted(sections) == sorted(f"{w}_batch{b}" for w in ("quote", "free") for b in (1, 4, 8, "16_forced"))
    for key in sections:
        assert r[key]["same_tokens"] is True and r[key]["plain_tok_s"] > 0 and r[key]["spec_tok_s"] > 0
        assert 0 <= r[key]["acceptance"] <= 1


def test_bench_fleet_runs_each_routing_on_a_real_ray_serve_deployment(tmp_path):
    with one_ray_cluster():
        r = run_bench(tmp_path, "fleet", "--model", "synthetic:tiny", "--replicas", "2", "--adapters", "6",
                      "--requests", "12", "--new-tokens", "4", "--rounds", "1", "--max-loras", "2",
                      "--max-cpu-loras", "2", "--hop-requests", "5", "--popularity", "zipf:1.5")
    assert r["popularity"] == "zipf:1.5" and 1 <= r["adapters_used"] <= 6 and r["threads_per_replica"] >= 1
    assert set(r["policies"]) == {"affinity", "serve_default", "serve_untagged"}
    for p in r["policies"].values():
        assert p["tok_s"] > 0 and len(p["rounds_tok_s"]) == 1 and p["ttft_p95_ms"] >= p["ttft_p50_ms"] > 0
        # both replicas answered; each started its share of the turn's requests (the warm-up's left out)
        assert len(p["rounds_requests_per_replica"][0]) == 2 and sum(p["rounds_requests_per_replica"][0]) == 12
        assert sum(p["rounds_adapters_per_replica"][0]) >= 6 and p["rounds_steps"][0] > 0
        # fresh replicas and adapter ids every turn: each adapter used was loaded into some replica's slot
        assert p["adapter_loads"] >= r["adapters_used"] and p["adapter_loads_per_request"] == round(
            p["adapter_loads"] / r["requests"], 3)
    hop = r["hop"]
    assert hop["requests"] == 5 and all(hop[k][f"{side}_p50_ms"] > 0 for k in ("1_tokens", "32_tokens")
                                        for side in ("in_process", "replica"))
    one = hop["1_tokens"]
    assert hop["added_ms_per_request"] == round(one["replica_p50_ms"] - one["in_process_p50_ms"], 3)
    for other in ("serve_default", "serve_untagged"):
        assert r["ratios"][f"tok_s_affinity_vs_{other}"] == round(
            r["policies"]["affinity"]["tok_s"] / r["policies"][other]["tok_s"], 3)
    targets = r["targets"]  # the issue's, recorded beside what was measured
    assert targets["hop_added_ms_per_request"] == {"at_most": 3.0, "measured": hop["added_ms_per_request"],
                                                   "met": hop["added_ms_per_request"] <= 3.0}
    assert all(isinstance(t["met"], bool) for t in targets.values()) and len(targets) == 4


def test_bench_fleet_refuses_bad_options_in_one_line(tmp_path):
    for args, says in [(("--popularity", "pareto"), "--popularity is uniform or zipf:<s>, got 'pareto'"),
                       (("--replicas", "0"), "--replicas must be at least 1, got 0"),
                       (("--hop-requests", "-1"), "--hop-requests must be at least 0, got -1")]:
        bad = loraplex("bench", "fleet", *args, "--json", str(tmp_path / "bad.json"))
        lines = bad.stderr.strip().splitlines()
        assert bad.returncode == 2 and lines == [f"loraplex: error: {says}"], bad.stderr


def test_bench_quant_compares_weight_formats_at_each_batch(tmp_path):
    r = run_bench(tmp_path, "quant", "--model", "synthetic:tiny", "--batches", "1,3", "--new-tokens", "4",
                  "--rounds", "2")
    fmts = ("fp32", "bf16", "int8", "int4")  # (no gguf: a synthetic model has no file of its own)
    assert set(r["packed_bytes"]) == set(fmts) and r["packed_bytes"]["bf16"] * 2 == r["packed_bytes"]["fp32"]
    assert r["packed_bytes"]["int4"] < r["packed_bytes"]["int8"] < r["packed_bytes"]["bf16"]
    assert r["resident_bytes"]["int4"] < r["resident_bytes"]["fp32"]
    ppl = r["perplexity"]
    assert all(ppl[f] > 1 for f in fmts) and r["perplexity_vs_fp32"]["int8"] == round(ppl["int8"] / ppl["fp32"], 4)
    for key, batch in (("batch1", 1), ("batch3", 3)):
        row = r[key]
        assert all(row[f"{f}_tok_s"] > 0 and len(row["rounds"][f]) == 2 for f in fmts)
        assert row["int4_vs_fp32"] == round(row["int4_tok_s"] / row["fp32_tok_s"], 3)
        assert row["agreement"]["int8"]["requests"] == batch
    assert r["batch1"]["int4_roofline_tok_s"] == round(r["mem_read_gbs"] * 1e9 / r["packed_bytes"]["int4"], 2)
    for args, says in ((("--batches", "0"), "--batches: positive batch sizes"),
                       (("--formats", "bf16,int3"), "--formats: fp32 and any of")):
        bad = loraplex("bench", "quant", *args, "--json", str(tmp_path / "bad.json"))
        assert bad.returncode == 2 and says in bad.stderr


def test_bench_blocks_times_each_format_against_fp32_and_bf16_panels(tmp_path):
    r = run_bench(tmp_path, "blocks", "--formats", "q4_k,q6_k,q8_0", "--rows", "1,3", "--shapes", "small",
                  "--repeats", "1", "--calls", "1")
    formats = ("q4_k", "q6_k", "q8_0")
    assert [(e["format"], e["rows"]) for e in r["results"]] == [(f, m) for f in formats for m in (1, 3)]
    for e in r["results"]:
        assert e["shape"] == [256, 512] and set(e["ms"]) == {e["format"], "fp32", "bf16", "int8_act"}
        assert min(e["ms"].values()) > 0 and e["fp32_over_blocks"] > 0 and e["bf16_over_blocks"] > 0
        assert e["int8_act_over_fp32"] > 0 and e["int8_act_over_blocks"] > 0
    bits = {e["format"]: e["bits_per_weight"] for e in r["results"]}
    # the panels' bits (quant_blocks.h) over 256 outputs padded to whole panels of this build (48 with AVX-512)
    padded = -(-256 // panel_columns()) * panel_columns() / 256
    assert bits == {f: round(b * padded, 3) for f, b in (("q4_k", 4.625), ("q6_k", 6.5625), ("q8_0", 8.5))}
    for args, says in ((("--formats", "q4_2"), "--formats: any of q8_0"), (("--rows", "0"), "--rows: row counts")):
        bad = loraplex("bench", "blocks", *args, "--json", str(tmp_path / "bad.json"))
        assert bad.returncode == 2 and says in bad.stderr and not (tmp_path / "bad.json").exists()


def test_bench_fuzz_writes_cases_failures_and_reproductions(tmp_path):
    r = run_bench(tmp_path, "fuzz", "--cases", "40")
    assert r["cases"] >= 40 and r["cases_asked"] == 40 and r["server_alive_after"] is True
    assert sum(op["cases"] for op in r["by_operation"].values()) == r["cases"]
    assert r["failed_cases"] == sum(sum(s.values()) for s in r["failures_by_endpoint"].values())
    for failure in r["distinct_failures"]:  # whatever the server gets wrong today, each comes with a repro
        assert failure["curl"].startswith("curl ") and failure["python"].startswith("requests.request(")
        assert "$LORAPLEX_KEY" in failure["python"] or "$LORAPLEX_ADMIN_TOKEN" in failure["python"]


def test_bench_soak_loses_nothing_and_comes_back_to_baseline(tmp_path):
    """A short soak: its report's structure and the no-loss facts, not its timings."""
    r = run_bench(tmp_path, "soak", "--seconds", "2", "--clients", "3",
                  "--database-url", os.environ.get("LORAPLEX_TEST_DATABASE_URL", PG_SERVER),
                  "--redis-url", os.environ.get("LORAPLEX_TEST_REDIS_URL", "redis://localhost:6379/0"))
    clean, hostile = r["phases"]["clean"], r["phases"]["hostile"]
    assert clean["completed"] > 0 and hostile["completed"] > 0
    assert r["completed"] == clean["completed"] + hostile["completed"]
    assert r["well_behaved_errors"] == 0, (clean["errors_sample"], hostile["errors_sample"])
    assert set(hostile["hostile"]) == {h.kind for h in hostile_requests("m")}  # every kind was sent
    assert all(phase["ttft_ms"]["p99"] >= phase["ttft_ms"]["p50"] > 0 for phase in (clean, hostile))
    assert {"ttft_p99_ratio", "rss", "engine", "ledger"} <= set(r) and r["rss"]["end_mb"] > 0
    assert r["engine"]["back_at_baseline"] is True, r["engine"]
    assert r["engine"]["end"]["requests"]["running"] == r["engine"]["end"]["requests"]["waiting"] == 0
    assert r["ledger"]["missing"] == [] and r["ledger"]["rows_for_refused_or_unknown"] == []
    assert r["ledger"]["equal"] is True and r["ledger"]["rows"] >= r["completed"]
    assert r["server_exit_code"] == 0
