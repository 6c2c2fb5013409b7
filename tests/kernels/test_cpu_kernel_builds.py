"""The narrower builds of the CPU kernels, run on this machine: the packed GEMM and the fold have one
layout per vector width (48-column panels with AVX-512, 24 with AVX2 or none), and lora.c's tile
kernel and the argmax one body per width, the 16-bit slot stores a vector, an F16C and a by-hand
form, bf16 weight panels a widening load per width and a by-hand one, GGUF block panels a dequantizing
load per width and a by-hand one, and the decode attention's 16- and 8-bit KV rows an AVX-512 loop (the native
build), an AVX2 + F16C load and a by-hand one, so the tests of the
width-dependent kernels run again in a child process under each build a smaller CPU would get.
A narrower build that targets the native build's instruction sets (-mno-avx512f on a CPU without AVX-512) is
the build the rest of the suite already runs, so it is not run twice.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from loraplex.engine.kernels.cpu import build, linear

pytestmark = pytest.mark.skipif(not linear.linear_available(), reason="the CPU kernels are not built")

HERE = os.path.dirname(__file__)
LAYOUT_TESTS = [
    os.path.join(HERE, "test_cpu_lora_fold.py"),
    os.path.join(HERE, "test_cpu_kernels.py") + "::test_packed_linear_matches_f_linear",
    os.path.join(HERE, "test_cpu_kernels.py") + "::test_packed_kernel_prefetch_and_thread_edges",
    os.path.join(HERE, "test_cpu_decode_step.py")
    + "::test_an_adapter_holding_most_of_the_batch_is_folded_into_the_gemms",
    os.path.join(HERE, "test_cpu_lora.py") + "::test_many_tokens_of_one_slot",  # the tile kernel
    os.path.join(HERE, "test_cpu_lora.py") + "::test_ranks_mixed_across_slots",
    os.path.join(HERE, "test_cpu_argmax.py"),  # one vector body per width
    os.path.join(HERE, "test_cpu_copy_blocks.py"),  # 16-bit stores: vector, F16C, or by hand
    os.path.join(HERE, "test_cpu_bf16_weights.py"),  # bf16 panels: widened per vector width, or by hand
    os.path.join(HERE, "test_cpu_quant_weights.py"),  # GGUF blocks: dequantized per vector width, or by hand
    os.path.join(HERE, "test_kv_cache_dtypes.py"),  # KV rows: AVX-512 (native), AVX2 + F16C loads, or by hand
    INT8_ACTIVATION_TESTS := os.path.join(HERE, "test_cpu_int8_activations.py"),  # vpmaddwd per width, or by hand
]
# AVX-512 without VNNI: the int8-activation GEMM's vpmaddwd form at 48 columns (the native build's vpdpbusd)
NO_VNNI = ("-mno-avx512vnni", 48)
# AVX2 without AVX-VNNI: its vpmaddwd form at 24 columns, where -mno-avx512f keeps AVX-VNNI's 256-bit vpdpbusd
AVX2_NO_VNNI = ("-mno-avx512f -mno-avxvnni", 24)


NARROWER_BUILDS = [
    ("-mno-avx512f", 24),                       # AVX2 and FMA: 4 x 24 kernel
    ("-mno-avx512f -mno-avx2 -mno-fma -mno-f16c", 24),  # no vector intrinsics: the portable loops
]


def narrower_than_native() -> list[tuple[str, int]]:
    """The NARROWER_BUILDS whose instruction sets differ from the native build's (all, without a compiler:
    the test is skipped then anyway)."""
    native = build.build_instruction_sets()
    return [(cflags, columns) for cflags, columns in NARROWER_BUILDS
            if native is None or build.build_instruction_sets(tuple(cflags.split())) != native]


def test_the_narrowing_flags_take_effect_and_a_vector_cpu_keeps_the_portable_build():
    portable = build.build_instruction_sets(tuple(NARROWER_BUILDS[-1][0].split()))
    assert portable is not None and not {"AVX-512F", "AVX2", "FMA", "F16C"} & set(portable)
    if "AVX2" in build.build_instruction_sets():
        assert NARROWER_BUILDS[-1] in narrower_than_native()


@pytest.mark.parametrize("cflags,columns", narrower_than_native())
def test_the_layout_dependent_kernels_pass_under_a_narrower_build(cflags, columns):
    _passes_under(cflags, columns, LAYOUT_TESTS)


@pytest.mark.skipif("AVX-512 VNNI" not in (build.build_instruction_sets() or ()), reason="a build without VNNI is "
                    "this machine's own")
def test_the_int8_activation_gemm_passes_without_vnni():
    _passes_under(*NO_VNNI, [INT8_ACTIVATION_TESTS])


@pytest.mark.skipif("AVX-VNNI" not in (build.build_instruction_sets(("-mno-avx512f",)) or ()),
                    reason="the AVX2 build here has no AVX-VNNI: -mno-avx512f already runs its vpmaddwd form")
def test_the_int8_activation_gemm_passes_in_an_avx2_build_without_avx_vnni():
    _passes_under(*AVX2_NO_VNNI, [INT8_ACTIVATION_TESTS])


def _passes_under(cflags: str, columns: int, tests: list[str]) -> None:
    env = dict(os.environ, LORAPLEX_CPU_CFLAGS=f"{os.environ.get('LORAPLEX_CPU_CFLAGS', '')} {cflags}")  # (-Werror)
    probe = subprocess.run([sys.executable, "-c", "from loraplex.engine.kernels.cpu import linear; "
                            "print(linear.panel_columns())"], env=env, capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert int(probe.stdout.strip()) == columns
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout
