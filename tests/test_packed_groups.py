"""Whole sequences padded together into one SDPA call (attention/packed_groups.py): equal to
attention over each sequence alone, with SDPA given a mask only where one is needed (a causal
group's padding sits past every real query, so its flash kernel may skip the blocks above the
diagonal)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vacpack.attention.backend import AttentionSpec
from vacpack.attention.packed_groups import packed_attention, packed_group

CPU = torch.device("cpu")
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 16


def _alone(q, k, v, causal: bool, window: int | None) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """One sequence's attention, [tokens, heads, dim], as SDPA computes it by itself."""
    n = q.shape[0]
    offsets = torch.arange(n).unsqueeze(1) - torch.arange(n).unsqueeze(0)  # query - key
    mask = offsets >= 0 if causal else torch.ones(n, n, dtype=torch.bool)
    if window is not None:
        mask &= offsets < window
    out = F.scaled_dot_product_attention(
        *(x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)), attn_mask=mask, enable_gqa=True
    )
    return out.squeeze(0).transpose(0, 1)


@pytest.mark.parametrize(
    ("lengths", "causal", "window", "masked"),
    [
        ([30, 21, 26], True, None, False),  # padded, causal: no mask
        ([30, 21, 26], True, 8, True),  # a window needs its mask
        ([30, 21, 26], False, None, True),  # bidirectional: padded keys are masked
        ([24, 24], False, None, False),  # bidirectional without padding: no mask
        ([24, 24], True, None, False),
    ],
    ids=["causal", "causal-window", "bidirectional-padded", "bidirectional-equal", "causal-equal"],
)
def test_a_group_equals_each_sequence_alone(
    lengths: list[int], causal: bool, window: int | None, masked: bool
) -> None:
    generator = torch.Generator().manual_seed(sum(lengths))
    num_tokens = sum(lengths)
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=generator)
    k, v = (torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=generator) for _ in "kv")
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    group = packed_group(starts, lengths, causal, CPU, window)

    assert (group.sdpa_mask is not None) == masked
    assert group.sdpa_causal == (causal and window is None)
    spec = AttentionSpec(sliding_window=window)
    got = packed_attention(q, k, v, group, spec)
    for start, length in zip(starts, lengths, strict=True):
        rows = slice(start, start + length)
        # The group's output rows are its sequences' real tokens, in group order.
        expected = _alone(q[rows], k[rows], v[rows], causal, window)
        position = group.out_rows.tolist().index(start)
        torch.testing.assert_close(
            got[position : position + length], expected, atol=1e-5, rtol=1e-5
        )
