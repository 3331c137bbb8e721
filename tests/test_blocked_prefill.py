"""Blocked causal prefill attention equals SDPA, and the portable backend uses it where it
should: long bf16 prefill segments on a CPU, fresh or over cached pages."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from mixed_step import PREFILL_LEN, mixed_step

from vacpack.attention import BatchLayout, blocked_prefill, create_backend
from vacpack.attention.blocked_prefill import blocked_causal_attention, use_blocked_prefill

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
CPU = torch.device("cpu")


def _reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Float32 SDPA over [tokens, heads, dim] tensors, the queries being the last tokens."""
    num_queries, num_keys = q.shape[0], keys.shape[0]
    positions = torch.arange(num_keys - num_queries, num_keys)
    mask = torch.arange(num_keys) <= positions.unsqueeze(1)
    out = F.scaled_dot_product_attention(
        *(x.float().transpose(0, 1).unsqueeze(0) for x in (q, keys, values)),
        attn_mask=mask,
        enable_gqa=True,
    )
    return out.squeeze(0).transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", [(6, 2), (4, 4), (3, 1)], ids=["gqa", "mha", "mqa"])
@pytest.mark.parametrize(
    ("num_queries", "num_keys"),
    # One block, a partial last block, exact blocks, queries over a cached prefix, one query.
    [(40, 40), (150, 150), (128, 128), (70, 300), (1, 257)],
)
def test_blocked_equals_sdpa(
    dtype: torch.dtype, heads: tuple[int, int], num_queries: int, num_keys: int
) -> None:
    num_heads, num_kv_heads = heads
    generator = torch.Generator().manual_seed(num_queries + num_keys)
    q = torch.randn(num_queries, num_heads, 16, generator=generator).to(dtype)
    keys = torch.randn(num_keys, num_kv_heads, 16, generator=generator).to(dtype)
    values = torch.randn(num_keys, num_kv_heads, 16, generator=generator).to(dtype)
    out = blocked_causal_attention(q, keys, values)
    assert out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(
        out.float(), _reference(q, keys, values), atol=TOLERANCE[dtype], rtol=0
    )


def test_only_long_segments_are_blocked_as_measured_or_by_default() -> None:
    q = torch.zeros(1, 2, 8, dtype=torch.bfloat16)
    # Nothing measured: long bf16 segments on a CPU.
    assert use_blocked_prefill(q, blocked_prefill.MIN_KEYS)
    assert not use_blocked_prefill(q, blocked_prefill.MIN_KEYS - 1)
    assert not use_blocked_prefill(q.float(), blocked_prefill.MIN_KEYS)
    # Measured: as chosen, in any dtype, still only from MIN_KEYS keys on.
    assert use_blocked_prefill(q.float(), blocked_prefill.MIN_KEYS, blocked=True)
    assert not use_blocked_prefill(q, blocked_prefill.MIN_KEYS, blocked=False)
    assert not use_blocked_prefill(q, blocked_prefill.MIN_KEYS - 1, blocked=True)


@pytest.mark.parametrize("cached_tokens", [0, 90], ids=["fresh", "over-cached-pages"])
def test_portable_backend_runs_long_bf16_prefills_blocked(monkeypatch, cached_tokens) -> None:
    """A 300-token prefill in bf16, next to a decode: the blocked path runs and its output
    equals float32 attention over the same keys."""
    calls = []

    def counting(*args: torch.Tensor) -> torch.Tensor:
        calls.append(args[0].shape[0])
        return blocked_causal_attention(*args)

    monkeypatch.setattr("vacpack.attention.torch_sdpa.blocked_causal_attention", counting)
    step = mixed_step(cached_tokens, num_heads=4, num_kv_heads=2, head_dim=16)
    backend = create_backend("torch_sdpa")
    metadata = backend.build_metadata(step.layout, torch.device("cpu"))
    out = backend.forward(step.q, step.k, step.v, step.layer, metadata)
    assert calls == [PREFILL_LEN]
    slots = step.prefill_slots
    expected = _reference(step.q[1:], step.layer.keys[slots], step.layer.values[slots])
    torch.testing.assert_close(out[1:].float(), expected, atol=3e-2, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("blocked", [True, False], ids=["blocked", "sdpa"])
def test_the_measured_prefill_kernel_runs_and_matches_float32(
    monkeypatch, dtype: torch.dtype, blocked: bool
) -> None:
    """Either choice of measured selection (blocked_prefill.py's `blocked`), in either dtype,
    over a whole sequence and over cached pages, equals float32 attention."""
    calls = []

    def counting(*args: torch.Tensor) -> torch.Tensor:
        calls.append(args[0].shape[0])
        return blocked_causal_attention(*args)

    monkeypatch.setattr("vacpack.attention.torch_sdpa.blocked_causal_attention", counting)
    backend = create_backend("torch_sdpa", blocked_prefill=blocked)
    generator = torch.Generator().manual_seed(3)
    q, keys, values = (
        torch.randn(PREFILL_LEN, heads, 16, generator=generator).to(dtype) for heads in (4, 2, 2)
    )
    layout = BatchLayout([PREFILL_LEN], [PREFILL_LEN])
    out = backend.forward(q, keys, values, None, backend.build_metadata(layout, CPU))
    torch.testing.assert_close(
        out.float(), _reference(q, keys, values), atol=TOLERANCE[dtype], rtol=0
    )
    if dtype == torch.bfloat16:  # the mixed step's cache is bf16
        step = mixed_step(90, num_heads=4, num_kv_heads=2, head_dim=16)
        metadata = backend.build_metadata(step.layout, CPU)
        out = backend.forward(step.q, step.k, step.v, step.layer, metadata)
        slots = step.prefill_slots
        expected = _reference(step.q[1:], step.layer.keys[slots], step.layer.values[slots])
        torch.testing.assert_close(out[1:].float(), expected, atol=3e-2, rtol=0)
    assert calls == ([PREFILL_LEN] * len(calls) if blocked else [])
    assert len(calls) == (0 if not blocked else 1 + (dtype == torch.bfloat16))
