"""Cascade attention: decodes that share a prefix of KV pages read it once, together.

Attention over a sequence's keys splits exactly into attention over any two parts of them, each
with the log-sum-exp (LSE) of its scores: the full result is the two partial results weighted by
exp(lse_part - lse_total). So a group's shared prefix is attended by all the group's query heads
in one matmul per KV head ([seqs * grouped heads, head_dim] x [head_dim, prefix tokens]: one
compute-bound matmul instead of one bandwidth-bound read of the prefix per sequence), each
sequence's own remaining pages by the ordinary paged decode, and the two merged by LSE weights
in float32.

The prefix part runs in one of PREFIX_FORMS, measured at the model's shapes
(attention/selection.py): "matmuls", batched matmuls around a float32 softmax over the gathered
prefix; or "kernel", the C varlen attention kernel (vacpack/cpu_kernels), which reads the
prefix's pages in place and keeps the scores in registers, where it runs for the model's dtype
and head size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vacpack.attention.backend import FULL_ATTENTION, AttentionSpec
from vacpack.attention.paged_decode import DecodeChunk, attend, chunk_attention, gather_pages
from vacpack.cpu_kernels import KernelSequences, attend_with_lse, paged_sequences
from vacpack.cpu_kernels.lse_merge import lse_merge_supported, merge_rows_by_lse_
from vacpack.kvcache.paged_cache import KVLayer

PREFIX_FORMS = ("matmuls", "kernel")


@dataclass(frozen=True)
class CascadePolicy:
    """When decodes sharing leading pages run as a cascade: their shared prefix holds at least
    min_prefix_tokens, and without the cascade they would read at least min_saved_tokens of the
    prefix's keys more than once ((seqs - 1) * prefix tokens). Below either, the cascade's extra
    kernel launches and merge cost more than the reads they save."""

    min_prefix_tokens: int
    min_saved_tokens: int


# From bench/decode_attention.py --sweep on a 2-core CPU (one thread, 64 sequences): a cascade
# did not pay for 128-token prefixes even shared by all 64 (within 3%), lost for any group
# saving fewer than ~1,800 reads, won from ~3,000 saved reads on 512- and 1,024-token prefixes,
# and by 13-52% once all 64 shared 256 tokens or more. Two threads speed the reads more than
# the launches, so the threshold keeps a margin over that break-even.
DEFAULT_CASCADE_POLICY = CascadePolicy(min_prefix_tokens=256, min_saved_tokens=4096)


# Scores per block of a prefix's query rows: 2 MiB of float32 scores, which stay in cache from
# the score matmul through the softmax to the values matmul, and stay small enough that the
# allocator reuses them instead of mapping fresh pages. At 128 sequences x 1,024 prefix tokens
# this measured 15% faster than one block, and halving it gained nothing.
PREFIX_BLOCK_SCORES = 1 << 19


@dataclass(frozen=True)
class CascadeGroup:
    """Decodes sharing their first `num_prefix_tokens` tokens' pages."""

    rows: torch.Tensor  # [seqs] stream rows of the group's query tokens
    prefix_pages: torch.Tensor  # [prefix pages] the shared page ids, in order
    num_prefix_tokens: int
    # The prefix as the C kernel reads it, for the "kernel" prefix form (else None): one
    # bidirectional sequence whose queries are all the group's rows.
    kernel_prefix: KernelSequences | None = None


def cascade_group(
    rows: list[int],
    prefix_pages: list[int],
    page_size: int,
    device: torch.device,
    prefix_form: str = "matmuls",
) -> CascadeGroup:
    """The group of decodes at stream rows `rows` sharing the pages `prefix_pages`."""
    if prefix_form not in PREFIX_FORMS:
        raise ValueError(f"prefix_form must be one of {PREFIX_FORMS}, got {prefix_form!r}")
    num_prefix_tokens = len(prefix_pages) * page_size
    kernel_prefix = None
    if prefix_form == "kernel":
        kernel_prefix = paged_sequences(
            torch.tensor([0, len(rows)]),
            torch.tensor([num_prefix_tokens]),
            torch.tensor([prefix_pages], dtype=torch.int64),
            page_size,
            causal=False,
        )
    return CascadeGroup(
        rows=torch.tensor(rows, dtype=torch.int64).to(device),
        prefix_pages=torch.tensor(prefix_pages, dtype=torch.int64).to(device),
        num_prefix_tokens=num_prefix_tokens,
        kernel_prefix=kernel_prefix,
    )


@dataclass(frozen=True)
class CascadePlan:
    groups: tuple[CascadeGroup, ...]
    # The members' own pages past their group's prefix, as ordinary decode chunks.
    suffix_chunks: tuple[DecodeChunk, ...]


def prefix_attention(
    q: torch.Tensor, kv_layer: KVLayer, group: CascadeGroup, spec: AttentionSpec = FULL_ATTENTION
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [seqs, heads, head_dim], the group's query rows. Returns their attention over the
    shared prefix alone, shaped like q, and its float32 log-sum-exp, [seqs, heads]."""
    if group.kernel_prefix is not None and spec.logit_softcap is None:
        return attend_with_lse(
            q, kv_layer.key_rows(), kv_layer.values, group.kernel_prefix, scale=spec.scale
        )
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = kv_layer.num_kv_heads
    group_size = num_heads // num_kv_heads
    num_rows = num_seqs * group_size
    page_size, num_keys = kv_layer.page_size, group.num_prefix_tokens
    keys = gather_pages(kv_layer.key_rows(), group.prefix_pages, page_size, 1, num_keys, q.dtype)[0]
    values = gather_pages(kv_layer.values, group.prefix_pages, page_size, 1, num_keys, q.dtype)[0]
    # Every sequence's query heads of one KV head become rows of that head's one matmul.
    rows = q.view(num_seqs, num_kv_heads, group_size, head_dim).transpose(0, 1)
    rows = rows.reshape(num_kv_heads, num_rows, head_dim)
    out = q.new_empty(num_kv_heads, num_rows, head_dim)
    lse = q.new_empty(num_kv_heads, num_rows, dtype=torch.float32)
    block_rows = max(1, PREFIX_BLOCK_SCORES // (num_kv_heads * num_keys))
    for start in range(0, num_rows, block_rows):
        block = slice(start, start + block_rows)
        block_out, block_lse = attend(
            rows[:, block], keys, values, None, True, spec.scale, spec.logit_softcap
        )
        assert block_lse is not None  # asked for
        out[:, block], lse[:, block] = block_out, block_lse
    out = out.view(num_kv_heads, num_seqs, group_size, head_dim).transpose(0, 1)
    lse = lse.view(num_kv_heads, num_seqs, group_size).transpose(0, 1)
    return out.reshape(num_seqs, num_heads, head_dim), lse.reshape(num_seqs, num_heads)


def merge_by_lse(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor:
    """Attention over the union of two disjoint key sets, from each set's output [..., dim] and
    log-sum-exp [...]; weights and sums in float32, the result in out_a's dtype."""
    # a's weight exp(lse_a - logaddexp(lse_a, lse_b)) is sigmoid(lse_a - lse_b): no overflow.
    weight_a = torch.sigmoid(lse_a - lse_b).unsqueeze(-1)
    return torch.lerp(out_b.float(), out_a.float(), weight_a).to(out_a.dtype)


def merge_prefix_into(
    out: torch.Tensor,
    lse: torch.Tensor,
    rows: torch.Tensor,
    prefix_out: torch.Tensor,
    prefix_lse: torch.Tensor,
) -> torch.Tensor:
    """out[rows] := attention over their own keys (out[rows], lse[rows]) and a shared prefix's
    (prefix_out, prefix_lse, one row per entry of rows), in place; returns out. On a CPU in one
    pass of C (cpu_kernels/lse_merge.c), elsewhere as merge_by_lse between gathers."""
    if lse_merge_supported(out, prefix_out):
        merge_rows_by_lse_(out, lse, rows, prefix_out, prefix_lse)
        return out
    merged = merge_by_lse(
        prefix_out, prefix_lse, out.index_select(0, rows), lse.index_select(0, rows)
    )
    return out.index_copy_(0, rows, merged)


def cascade_attention(
    q: torch.Tensor,
    kv_layer: KVLayer,
    plan: CascadePlan,
    out: torch.Tensor,
    spec: AttentionSpec = FULL_ATTENTION,
    suffix_form: str = "matmuls",
) -> None:
    """Writes into `out` ([tokens, heads, head_dim]) the attention of every row in the plan
    (full attention: a sliding-window layer never runs a cascade). suffix_form: how the rows'
    own pages are attended (paged_decode.DECODE_FORMS; SDPA gives no log-sum-exp, so it runs
    as matmuls)."""
    suffix_lse = q.new_empty(q.shape[:2], dtype=torch.float32)
    for chunk in plan.suffix_chunks:
        attn, lse = chunk_attention(
            q.index_select(0, chunk.rows),
            kv_layer,
            chunk,
            with_lse=True,
            spec=spec,
            form=suffix_form,
        )
        assert lse is not None  # asked for
        out.index_copy_(0, chunk.rows, attn)
        suffix_lse.index_copy_(0, chunk.rows, lse)
    for group in plan.groups:
        prefix_out, prefix_lse = prefix_attention(
            q.index_select(0, group.rows), kv_layer, group, spec
        )
        merge_prefix_into(out, suffix_lse, group.rows, prefix_out, prefix_lse)
