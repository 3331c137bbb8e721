"""Whole short sequences of a packed bin (no KV cache), attended together in one padded call.

Many embedding-sized documents padded to the longest of their group run as one SDPA call
instead of one each. A layer with soft-capped scores (which SDPA cannot apply) runs the same
padded batch as explicit matmuls around a float32 softmax.

Sequences are padded at their end, so a causal group needs no mask at all: a real query never
sees a key past itself, hence no padding, and SDPA's `is_causal` lets its flash kernel skip the
blocks above the diagonal, half of a long prefill's work, which an explicit mask makes it
compute (two causal 1,024-token sequences with Qwen2.5-0.5B's heads, float32 on a 2-core Zen 3:
67.3 ms a layer with the mask, as long as one of 2,048 tokens; 45.3 ms without). A group needs
its mask only for a sliding window, or without causality for padded keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vacpack.attention.backend import AttentionSpec


@dataclass(frozen=True)
class PackedGroup:
    """Whole sequences of similar length, run as one padded, masked SDPA call."""

    gather_rows: torch.Tensor  # [seqs * longest] stream row of each padded slot (padding: 0)
    num_seqs: int
    longest: int
    mask: torch.Tensor  # [seqs, 1, longest, longest]: real keys, causal and windowed as asked
    real_slots: torch.Tensor  # [num_real] which padded slots hold real tokens
    out_rows: torch.Tensor  # [num_real] the stream rows those slots belong to
    # What SDPA is given: `mask` where it is needed, else None and whether it is causal.
    sdpa_mask: torch.Tensor | None
    sdpa_causal: bool


def packed_group(
    starts: list[int],
    lengths: list[int],
    causal: bool,
    device: torch.device,
    window: int | None = None,
) -> PackedGroup:
    longest = max(lengths)
    slot_positions = torch.arange(longest)
    real = slot_positions < torch.tensor(lengths).unsqueeze(1)  # [seqs, longest]
    rows = torch.tensor(starts).unsqueeze(1) + slot_positions
    gather_rows = torch.where(real, rows, torch.zeros_like(rows)).flatten()
    mask = real[:, None, None, :].expand(-1, 1, longest, -1)
    if causal:
        # Padded query rows still see the real keys before them, so no row is fully masked.
        offsets = slot_positions.unsqueeze(1) - slot_positions.unsqueeze(0)  # query - key
        visible = offsets >= 0
        if window is not None:
            visible &= offsets < window
        mask = mask & visible
    real_slots = real.flatten().nonzero().squeeze(1)
    mask = mask.contiguous().to(device)
    plain_causal = causal and window is None
    mask_needed = not plain_causal and (window is not None or min(lengths) < longest)
    return PackedGroup(
        gather_rows=gather_rows.to(device),
        num_seqs=len(lengths),
        longest=longest,
        mask=mask,
        real_slots=real_slots.to(device),
        out_rows=rows.flatten()[real_slots].to(device),
        sdpa_mask=mask if mask_needed else None,
        sdpa_causal=plain_causal,
    )


def packed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: PackedGroup, spec: AttentionSpec
) -> torch.Tensor:
    """Attention of a group of whole sequences, padded to [seqs, heads, longest, head_dim]."""

    def padded(x: torch.Tensor) -> torch.Tensor:
        rows = x.index_select(0, group.gather_rows)
        return rows.view(group.num_seqs, group.longest, *x.shape[1:]).transpose(1, 2)

    if spec.logit_softcap is None:
        attn = F.scaled_dot_product_attention(
            padded(q),
            padded(k),
            padded(v),
            attn_mask=group.sdpa_mask,
            is_causal=group.sdpa_causal,
            enable_gqa=True,
            scale=spec.scale,
        )
    else:
        attn = _softcapped(padded(q), padded(k), padded(v), group.mask, spec)
    flat = attn.transpose(1, 2).reshape(-1, *q.shape[1:])
    return flat.index_select(0, group.real_slots)


def _softcapped(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, spec: AttentionSpec
) -> torch.Tensor:
    """q [seqs, heads, len, dim], k and v [seqs, kv_heads, len, dim]: each KV head's grouped
    query heads are the rows of one matmul, as in transformers' eager attention for Gemma 2."""
    num_seqs, num_heads, length, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group_size = num_heads // num_kv_heads
    rows = q.reshape(num_seqs, num_kv_heads, group_size * length, head_dim)
    scores = torch.matmul(rows, k.transpose(-1, -2)).float() * spec.scale_for(head_dim)
    cap = spec.logit_softcap
    assert cap is not None, "only soft-capped layers come here"
    scores = torch.tanh(scores / cap) * cap
    scores = scores.view(num_seqs, num_kv_heads, group_size, length, length)
    scores.masked_fill_(~mask.unsqueeze(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(num_seqs, num_kv_heads, -1, length)
    return torch.matmul(probs, v).view(num_seqs, num_heads, length, head_dim)
