"""The compute path's int8-activation line names the dot product linear_act8.h compiles to for a build's
instruction sets (its #if: AVX-512 needs BW, AVX2 needs FMA and F16C; VNNI's vpdpbusd at either width), or
why int8 activations cannot run."""

from __future__ import annotations

import pytest

from loraplex.engine.compute import _int8_dot

AVX2 = ("AVX2", "FMA", "F16C")


@pytest.mark.parametrize(("ops", "isa", "want"), [
    ("c", ("AVX-512F", "AVX-512BW", "AVX-512VL", "AVX-512 VNNI", *AVX2), "AVX-512 VNNI (vpdpbusd)"),
    ("c", ("AVX-512F", "AVX-512BW", "AVX-512VL", *AVX2), "AVX-512BW (vpmaddwd)"),
    ("c", ("AVX-512F", *AVX2), "portable loops"),  # AVX-512F without BW: linear_act8.h's plain loops
    ("c", AVX2, "AVX2 (vpmaddwd)"),
    ("c", ("AVX-VNNI", *AVX2), "AVX-VNNI (vpdpbusd, 256-bit)"),
    ("c", ("AVX-512F", "AVX-512BW", "AVX-VNNI", *AVX2), "AVX-512BW (vpmaddwd)"),  # AVX-VNNI is for 256-bit builds
    ("c", ("AVX2", "FMA"), "portable loops"),
    ("c", (), "portable loops"),
    ("torch", None, "not here (needs the C kernels)"),
    ("cuda", None, "not here (CPU C kernels only)"),
])
def test_the_int8_dot_follows_the_builds_instruction_sets(ops, isa, want):
    assert _int8_dot(ops, isa) == want
