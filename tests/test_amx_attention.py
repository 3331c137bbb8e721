"""The AMX attention kernel (varlen_attention_amx.c) against float32 attention, on the CPU's
tiles where it has AMX, and everywhere with its tile instructions emulated in plain C (tiles.h),
so that its layouts, strides, edges and masks are tested on machines without AMX; its
self-check, and the measured choice between it and the AVX-512 kernel."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from asan_build import worst_difference_under_asan
from bf16_kernel_marks import EMULATED, ON_AMX, TILE_KERNELS
from mixed_step import PREFILL_LEN, mixed_step
from test_cpu_kernels import (
    CASE_FIELDS,
    KERNEL_CASES,
    ScatteredPages,
    _cu,
    _random,
    _reference,
    check_cascade,
)

from vacpack import cpu_kernels
from vacpack.attention import create_backend, selection
from vacpack.attention.timed_steps import AttentionShapes, PackedBinShape
from vacpack.cpu_kernels import attention as kernel_attention
from vacpack.cpu_kernels import (
    paged_attention,
    paged_attention_with_lse,
    tile_kernel_ready,
    varlen_attention_supported,
)
from vacpack.tuning import ChoiceSource, MeasuredChoice

CPU = torch.device("cpu")
ATOL = 2e-2  # bf16 inputs and output, probabilities rounded to bf16 (as the AVX-512 kernel)


def _attend(q, k, v, lens_q, lens_k, causal, bf16_kernel):  # type: ignore[no-untyped-def]
    sequences = kernel_attention.packed_sequences(_cu(lens_q), _cu(lens_k), causal=causal)
    return kernel_attention.attend(q, k, v, sequences, bf16_kernel=bf16_kernel)


@pytest.mark.parametrize("bf16_kernel", TILE_KERNELS)
@pytest.mark.parametrize(
    CASE_FIELDS,
    [
        *KERNEL_CASES,
        # 96 dims: a value pass of four tiles, then one of two.
        pytest.param((4, 4), 96, False, [50, 3], [50, 3], id="dim96"),
    ],
)
def test_tile_kernel_equals_float32_attention(
    bf16_kernel, heads, head_dim, causal, lens_q, lens_k
) -> None:
    num_heads, num_kv_heads = heads
    generator = torch.Generator().manual_seed(sum(lens_q) + head_dim)
    q = _random(sum(lens_q), num_heads, head_dim, generator)
    k = _random(sum(lens_k), num_kv_heads, head_dim, generator)
    v = _random(sum(lens_k), num_kv_heads, head_dim, generator)

    out = _attend(q, k, v, lens_q, lens_k, causal, bf16_kernel)

    assert out.shape == q.shape and out.dtype == torch.bfloat16
    expected = _reference(q, k, v, lens_q, lens_k, causal)
    torch.testing.assert_close(out.float(), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("bf16_kernel", TILE_KERNELS)
@pytest.mark.parametrize("page_size", [8, 16, 48], ids=["page8", "page16", "page48"])
def test_tile_kernel_reads_pages_in_place_with_their_log_sum_exp(bf16_kernel, page_size) -> None:
    """Decodes, a fresh prefill and a prefill chunk over scattered pages in one call: each
    sequence equals float32 attention over its own slots, and each decode's log-sum-exp is
    over its scores."""
    step = ScatteredPages.random(page_size, torch.bfloat16)

    out = paged_attention(*step.arguments(), bf16_kernel=bf16_kernel)
    with_lse, lse = paged_attention_with_lse(*step.arguments(), bf16_kernel=bf16_kernel)

    torch.testing.assert_close(out.float(), step.expected(), atol=ATOL, rtol=0)
    assert torch.equal(with_lse, out)
    num_heads, num_kv_heads, head_dim = step.q.shape[1], step.key_cache.shape[1], step.q.shape[2]
    for row in range(3):  # the decodes: one query row each
        seen = step.key_cache[step.slots[row]].float()
        seen = seen.repeat_interleave(num_heads // num_kv_heads, 1)
        scores = torch.einsum("hd,khd->hk", step.q[row].float(), seen) * head_dim**-0.5
        torch.testing.assert_close(lse[row], scores.logsumexp(-1), atol=1e-3, rtol=0)


@pytest.mark.parametrize("bf16_kernel", TILE_KERNELS)
def test_the_backend_runs_an_engine_step_on_the_tiles(bf16_kernel) -> None:
    """A decode and a 300-token prefill over cached pages, through the cpu_kernels backend with
    bf16_kernel set: the prefill equals float32 attention over its slots, the decode the
    portable backend's."""
    step = mixed_step(90, num_heads=4, num_kv_heads=2, head_dim=64)
    kernels = create_backend("cpu_kernels", bf16_kernel=bf16_kernel)
    out = kernels.forward(
        step.q, step.k, step.v, step.layer, kernels.build_metadata(step.layout, CPU)
    )

    keys, values = step.layer.keys[step.prefill_slots], step.layer.values[step.prefill_slots]
    expected = _reference(step.q[1:], keys, values, [PREFILL_LEN], [step.context_len], True)
    torch.testing.assert_close(out[1:].float(), expected, atol=ATOL, rtol=0)
    portable = create_backend("torch_sdpa")
    decode = portable.forward(
        step.q, step.k, step.v, step.layer, portable.build_metadata(step.layout, CPU)
    )[:1]
    torch.testing.assert_close(out[:1].float(), decode.float(), atol=ATOL, rtol=0)


@pytest.mark.parametrize("bf16_kernel", TILE_KERNELS)
def test_a_cascade_runs_on_the_tiles(bf16_kernel) -> None:
    """Decodes sharing a prefix: their own pages and the prefix call on the tiles."""
    check_cascade(torch.bfloat16, bf16_kernel=bf16_kernel)


@ON_AMX
def test_a_cascade_runs_its_prefixes_on_the_tiles_and_its_own_pages_apart() -> None:
    check_cascade(torch.bfloat16, bf16_kernel="avx512_bf16", prefix_bf16_kernel="amx")


@EMULATED
def test_a_kernel_that_fails_its_self_check_is_not_used(monkeypatch, caplog) -> None:
    """Written where no AMX CPU was at hand, the AMX kernel proves itself where it runs: a
    kernel computing something else than attention is turned off, with a warning."""
    kernel_attention._tile_kernel.cache_clear()
    monkeypatch.setattr(kernel_attention, "SELF_CHECK_TOLERANCE", -1.0)  # nothing passes
    try:
        assert not tile_kernel_ready("emulated_tiles")
        assert not varlen_attention_supported(CPU, torch.bfloat16, 64, "emulated_tiles")
        assert "self-check differs from float32 attention" in caplog.text
    finally:
        kernel_attention._tile_kernel.cache_clear()
    monkeypatch.undo()
    assert tile_kernel_ready("emulated_tiles")


def test_an_unknown_bf16_kernel_is_refused() -> None:
    with pytest.raises(ValueError, match="bf16_kernel must be one of"):
        varlen_attention_supported(CPU, torch.bfloat16, 64, "avx9000")


def test_the_two_bf16_kernels_are_timed_where_both_run(monkeypatch) -> None:
    """Where the AVX-512 and the AMX kernel both run, the cpu_bf16_kernel phase times both on
    the phase's workload and the backend takes the one it chose; where one runs, nothing is
    timed."""
    shapes = AttentionShapes(num_heads=14, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    workload = PackedBinShape(4, 512, causal=True)
    asked: list[tuple[str, list[str]]] = []

    def measure(phase, shape_key, candidates, calls, **kwargs):  # type: ignore[no-untyped-def]
        asked.append((phase, list(candidates)))
        return MeasuredChoice(phase, shape_key, chosen="amx", source=ChoiceSource.MEASURED)

    runs = {"avx512_bf16": True, "amx": True}
    monkeypatch.setattr(
        cpu_kernels,
        "varlen_attention_supported",
        lambda device, dtype, head_dim, bf16_kernel="avx512_bf16": runs[bf16_kernel],
    )
    choice = selection._choose_bf16_kernel(CPU, shapes, workload, measure)
    assert choice is not None and choice.chosen == "amx"
    assert asked == [(selection.BF16_KERNEL_PHASE, ["avx512_bf16", "amx"])]

    runs["amx"] = False
    assert selection._choose_bf16_kernel(CPU, shapes, workload, measure) is None
    assert len(asked) == 1


ASAN_SCRIPT = """
import ctypes, sys
import torch
from vacpack.cpu_kernels import attention
from test_cpu_kernels import KERNEL_CASES, ScatteredPages, _cu, _random, _reference

kernel = ctypes.CDLL(sys.argv[1]).varlen_attention_amx
kernel.argtypes, kernel.restype = attention._ARGTYPES, ctypes.c_int
attention._tile_kernel = lambda name: kernel
torch.set_num_threads(2)
worst = attention._self_check(kernel)
for case in KERNEL_CASES:
    (num_heads, num_kv_heads), head_dim, causal, lens_q, lens_k = case.values
    generator = torch.Generator().manual_seed(0)
    q = _random(sum(lens_q), num_heads, head_dim, generator)
    k, v = (_random(sum(lens_k), num_kv_heads, head_dim, generator) for _ in "kv")
    sequences = attention.packed_sequences(_cu(lens_q), _cu(lens_k), causal=causal)
    out = attention.attend(q, k, v, sequences, bf16_kernel="emulated_tiles")
    expected = _reference(q, k, v, lens_q, lens_k, causal)
    worst = max(worst, float((out.float() - expected).abs().max()))
for page_size in (8, 48):
    step = ScatteredPages.random(page_size, torch.bfloat16)
    out, _ = attention.paged_attention_with_lse(*step.arguments(), bf16_kernel="emulated_tiles")
    worst = max(worst, float((out.float() - step.expected()).abs().max()))
print("worst difference", worst)
"""


def test_the_tile_kernel_stays_inside_its_buffers(tmp_path: Path) -> None:
    """The emulated kernel built with AddressSanitizer, on packed and paged cases: every tile
    load and store stays inside the memory it was given."""
    worst = worst_difference_under_asan(
        tmp_path, "varlen_attention_amx", "VACPACK_EMULATE_TILES", ASAN_SCRIPT
    )
    assert worst < ATOL
