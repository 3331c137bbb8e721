"""How the C kernel libraries build: once per machine into the cache, again when a kernel's
source or a header it may include changes, falling back with a warning where no compiler
builds them, and off when switched off."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from vacpack.cpu_kernels import build

# A portable kernel: it builds on any CPU with a C compiler.
PORTABLE = "argmax_f32"


@pytest.fixture
def kernel_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc")
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    return tmp_path


def test_a_library_builds_once_into_its_cache(kernel_cache: Path) -> None:
    library = build.load_kernel_library.__wrapped__(PORTABLE, portable=True)
    assert library is not None and hasattr(library, "argmax_f32")
    (built,) = kernel_cache.glob(f"{PORTABLE}-*.so")
    modified_ns = built.stat().st_mtime_ns
    assert build.load_kernel_library.__wrapped__(PORTABLE, portable=True) is not None
    assert built.stat().st_mtime_ns == modified_ns, "a cached library is not rebuilt"


def test_a_changed_header_builds_the_library_again(
    kernel_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert build.load_kernel_library.__wrapped__(PORTABLE, portable=True) is not None
    real_headers = build._headers_bytes()
    monkeypatch.setattr(build, "_headers_bytes", lambda: real_headers + b"// changed")
    assert build.load_kernel_library.__wrapped__(PORTABLE, portable=True) is not None
    assert len(list(kernel_cache.glob(f"{PORTABLE}-*.so"))) == 2


def test_the_bf16_kernels_build_where_the_cpu_has_the_instructions(kernel_cache: Path) -> None:
    if not set(build.REQUIRED_CPU_FLAGS) <= build.cpu_flags():
        assert build.load_kernel_library.__wrapped__("varlen_attention") is None
        return
    library = build.load_kernel_library.__wrapped__("varlen_attention")
    assert library is not None and hasattr(library, "varlen_attention_bf16")


def test_a_variant_builds_apart_where_the_cpu_has_its_flags(kernel_cache: Path) -> None:
    """The AMX kernel's emulated build (any CPU) is a library of its own beside the plain
    build's; a variant needing a CPU flag this CPU lacks is not built at all."""
    emulated = build.load_kernel_library.__wrapped__(
        "varlen_attention_amx", portable=True, variant=build.EMULATED_TILES
    )
    assert emulated is not None and hasattr(emulated, "varlen_attention_amx")
    assert len(list(kernel_cache.glob("varlen_attention_amx-emulated_tiles-*.so"))) == 1
    unknown = build.BuildVariant("future", ("-DFUTURE",), ("no_such_cpu_flag",))
    assert build.load_kernel_library.__wrapped__(PORTABLE, portable=True, variant=unknown) is None
    assert not list(kernel_cache.glob(f"{PORTABLE}-future-*.so"))
    has_amx = {"amx_tile", "amx_bf16", *build.REQUIRED_CPU_FLAGS} <= build.cpu_flags()
    amx = build.load_kernel_library.__wrapped__("varlen_attention_amx", variant=build.AMX)
    assert (amx is not None) == has_amx


def test_a_failing_build_falls_back_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    with caplog.at_level("WARNING"):
        assert build.load_kernel_library.__wrapped__(PORTABLE, portable=True) is None
    assert "failed to build" in caplog.text
    assert not list(tmp_path.glob("*.so*")), "no partial library is left behind"
    monkeypatch.setenv("CC", "no-such-compiler")
    with caplog.at_level("WARNING"):
        assert build.load_kernel_library.__wrapped__(PORTABLE, portable=True) is None
    assert "no C compiler" in caplog.text


def test_the_switch_turns_the_kernels_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(build.DISABLE_ENV, "0")
    assert build.load_kernel_library.__wrapped__("varlen_attention") is None
    assert build.load_kernel_library.__wrapped__(PORTABLE, portable=True) is None
