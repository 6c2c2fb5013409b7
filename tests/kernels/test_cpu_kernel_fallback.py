"""When the CPU kernels cannot be built: torch ops run, one WARNING says why, and `status()` (what
`loraplex doctor` and the startup log show) names the reason. User builds have no -Werror; the flags
are part of the cache key, so CI's LORAPLEX_CPU_CFLAGS=-Werror builds (and keeps) its own library."""

from __future__ import annotations

import logging
import stat

import pytest

from loraplex.engine.kernels.cpu import build


@pytest.fixture
def fresh_library(monkeypatch, tmp_path):
    """A library() that loads again under this test's environment (and again after it)."""
    monkeypatch.setenv("LORAPLEX_CACHE_DIR", str(tmp_path / "cache"))
    build.library.cache_clear()
    yield
    monkeypatch.undo()
    build.library.cache_clear()


def _fallback_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == build.__name__ and r.levelno == logging.WARNING]


def test_user_builds_have_no_werror_and_the_flags_key_the_cache(monkeypatch):
    monkeypatch.delenv("LORAPLEX_CPU_CFLAGS", raising=False)
    assert "-Werror" not in build.FLAGS and "-Werror" not in build.flags()
    cc = build._compiler()
    assert cc is not None, "this machine has a C compiler"
    user_key = build._key(cc)
    monkeypatch.setenv("LORAPLEX_CPU_CFLAGS", "-Werror")
    assert build.flags()[-1] == "-Werror" and build._key(cc) != user_key


def test_no_compiler_falls_back_to_torch_with_one_warning(monkeypatch, fresh_library, caplog):
    monkeypatch.setenv("CC", "false")  # on PATH, but `false --version` fails: not a compiler
    with caplog.at_level(logging.WARNING):
        assert build.library() is None and build.library() is None
        assert build.function("lp_panel_columns", None, []) is None
    status = build.status()
    assert not status.loaded and status.reason == "no C compiler ('false' is not on PATH or does not run)"
    (warning,) = _fallback_warnings(caplog)
    assert status.reason in warning and "falling back to torch ops" in warning


def test_a_compile_error_is_named_in_the_warning(monkeypatch, fresh_library, tmp_path, caplog):
    fake = tmp_path / "fakecc"
    fake.write_text('#!/bin/sh\n[ "$1" = --version ] && { echo fakecc 1.0; exit 0; }\n'
                    'echo "linear.c:1:1: warning: nothing" >&2\necho "linear.c:9:3: error: boom" >&2\nexit 1\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CC", str(fake))
    with caplog.at_level(logging.WARNING):
        assert build.library() is None
    status = build.status()
    assert status.reason == "compile error (exit 1): linear.c:9:3: error: boom"
    assert "warning: nothing" in status.detail
    (warning,) = _fallback_warnings(caplog)
    assert "compile error" in warning and "boom" in warning


def test_switched_off_says_so(monkeypatch, fresh_library):
    monkeypatch.setenv("LORAPLEX_CPU_KERNELS", "0")
    assert build.status() == build.KernelStatus(False, "switched off by LORAPLEX_CPU_KERNELS=0")
