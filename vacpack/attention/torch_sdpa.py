"""Portable attention in plain PyTorch, for CPU and CUDA alike.

Decodes (one query token each) run as paged matmuls in chunks of similar context length
(paged_decode.py); decodes whose page tables start with the same pages (a cached prefix) attend
to that prefix together, once, and to their own pages apart (cascade.py). Grouped-query heads
are folded into the query rows, so keys and values are never repeated per query head. Prefill
segments run one SDPA call each: causal over their own tokens, or over their gathered pages
with an offset causal mask when earlier chunks of the sequence are already cached; long bf16
segments on a CPU run as blocked matmuls instead (blocked_prefill.py), measured faster there.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vacpack.attention.backend import AttentionBackend, BatchLayout
from vacpack.attention.blocked_prefill import blocked_causal_attention, use_blocked_prefill
from vacpack.attention.cascade import (
    DEFAULT_CASCADE_POLICY,
    CascadeGroup,
    CascadePlan,
    CascadePolicy,
    cascade_attention,
)
from vacpack.attention.paged_decode import DecodeChunk, build_chunk, chunk_attention, plan_chunks
from vacpack.attention.shared_prefix import shared_decode_prefixes
from vacpack.kvcache.paged_cache import KVLayer

# Whole short sequences of a packed bin (no KV cache) run the same way, padded to the longest
# of their group: one SDPA call for many embedding-sized documents instead of one each.
PACKED_GROUP_MIN_FILL = 0.7


@dataclass(frozen=True)
class PackedGroup:
    """Whole sequences of similar length, run as one padded, masked SDPA call."""

    gather_rows: torch.Tensor  # [seqs * longest] stream row of each padded slot (padding: 0)
    num_seqs: int
    longest: int
    mask: torch.Tensor  # [seqs, 1, longest, longest]: real keys, and causal when causal
    real_slots: torch.Tensor  # [num_real] which padded slots hold real tokens
    out_rows: torch.Tensor  # [num_real] the stream rows those slots belong to


@dataclass(frozen=True)
class PrefillSegment:
    token_start: int
    query_len: int
    # Slots of the whole context and the causal mask; None when the segment has no cached prefix,
    # so attention reads the fresh k and v directly.
    context_slots: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass(frozen=True)
class SdpaMetadata:
    slot_mapping: torch.Tensor | None  # [num_tokens] where each token's k and v are written
    decode_chunks: tuple[DecodeChunk, ...]  # decodes without a shared prefix
    prefills: tuple[PrefillSegment, ...]
    causal: bool = True
    packed_groups: tuple[PackedGroup, ...] = ()
    cascade: CascadePlan | None = None  # decodes with one


def _context_slots(pages: torch.Tensor, page_size: int, num_tokens: int) -> torch.Tensor:
    offsets = torch.arange(page_size, dtype=torch.int64)
    return (pages.unsqueeze(-1) * page_size + offsets).flatten(-2)[..., :num_tokens]


def build_slot_mapping(layout: BatchLayout) -> torch.Tensor:
    """[num_tokens] int64 on the host: the cache slot each stream token's keys and values go to."""
    page_size, num_decodes = layout.page_size, layout.num_decodes
    # A decode's one slot in plain ints: tensor ops per sequence cost more host time here.
    slots: list[int] = []
    for context_len, pages in zip(
        layout.context_lens[:num_decodes], layout.page_tables[:num_decodes], strict=True
    ):
        position = context_len - 1
        slots.append(pages[position // page_size] * page_size + position % page_size)
    slot_chunks = [torch.tensor(slots, dtype=torch.int64)]
    for query_len, context_len, pages in zip(
        layout.query_lens[num_decodes:],
        layout.context_lens[num_decodes:],
        layout.page_tables[num_decodes:],
        strict=True,
    ):
        positions = torch.arange(context_len - query_len, context_len)
        page_ids = torch.tensor(pages, dtype=torch.int64)[positions // page_size]
        slot_chunks.append(page_ids * page_size + positions % page_size)
    return torch.cat(slot_chunks)


def _group_by_length(lengths: Sequence[int], min_fill: float, min_seqs: int) -> list[list[int]]:
    """Indices grouped longest first; a group closes below min_fill of its longest member,
    once it has min_seqs members."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for index in order:
        group = groups[-1] if groups else None
        if group is None or (
            len(group) >= min_seqs and lengths[index] < min_fill * lengths[group[0]]
        ):
            groups.append([index])
        else:
            group.append(index)
    return groups


def _decode_metadata(
    layout: BatchLayout, policy: CascadePolicy | None, device: torch.device
) -> tuple[tuple[DecodeChunk, ...], CascadePlan | None]:
    """Chunks for the decodes (the first layout.num_decodes sequences, one stream row each), and
    the cascade for those among them that share a long enough prefix of pages."""
    num_decodes, page_size = layout.num_decodes, layout.page_size
    page_tables = layout.page_tables[:num_decodes]
    context_lens = layout.context_lens[:num_decodes]
    prefixes = []
    if policy is not None:
        prefixes = shared_decode_prefixes(
            page_tables,
            context_lens,
            page_size,
            policy.min_prefix_tokens,
            policy.min_saved_tokens,
        )
    shared_pages = [0] * num_decodes
    for prefix in prefixes:
        for i in prefix.members:
            shared_pages[i] = prefix.num_pages

    def chunks(indices: list[int]) -> tuple[DecodeChunk, ...]:
        num_keys = [context_lens[i] - shared_pages[i] * page_size for i in indices]
        return tuple(
            build_chunk(
                [indices[j] for j in members],
                [page_tables[indices[j]][shared_pages[indices[j]] :] for j in members],
                [num_keys[j] for j in members],
                page_size,
                device,
            )
            for members in plan_chunks(num_keys)
        )

    plain = [i for i in range(num_decodes) if shared_pages[i] == 0]
    if not prefixes:
        return chunks(plain), None
    groups = tuple(
        CascadeGroup(
            rows=torch.tensor(prefix.members, dtype=torch.int64).to(device),
            prefix_pages=torch.tensor(
                page_tables[prefix.members[0]][: prefix.num_pages], dtype=torch.int64
            ).to(device),
            num_prefix_tokens=prefix.num_pages * page_size,
        )
        for prefix in prefixes
    )
    members = [i for i in range(num_decodes) if shared_pages[i] > 0]
    return chunks(plain), CascadePlan(groups, chunks(members))


class TorchSdpaBackend(AttentionBackend):
    name = "torch_sdpa"

    def __init__(self, cascade: CascadePolicy | None = DEFAULT_CASCADE_POLICY) -> None:
        self.cascade = cascade  # None: every decode reads its whole context itself

    def build_metadata(self, layout: BatchLayout, device: torch.device) -> SdpaMetadata:
        if not layout.page_tables:
            return self._prefill_only_metadata(layout, device)
        page_size = layout.page_size
        num_decodes = layout.num_decodes
        slot_mapping = build_slot_mapping(layout).to(device, non_blocking=True)
        decode_chunks, cascade = _decode_metadata(layout, self.cascade, device)
        prefills = []
        token_start = num_decodes  # decodes come first, one token each
        for i in range(num_decodes, len(layout.query_lens)):
            query_len, context_len = layout.query_lens[i], layout.context_lens[i]
            context_slots = mask = None
            if context_len > query_len:
                pages = torch.tensor(layout.page_tables[i], dtype=torch.int64)
                context_slots = _context_slots(pages, page_size, context_len).to(device)
                query_positions = torch.arange(context_len - query_len, context_len)
                mask = (torch.arange(context_len) <= query_positions.unsqueeze(1)).to(device)
            prefills.append(PrefillSegment(token_start, query_len, context_slots, mask))
            token_start += query_len
        return SdpaMetadata(slot_mapping, decode_chunks, tuple(prefills), cascade=cascade)

    @staticmethod
    def _prefill_only_metadata(layout: BatchLayout, device: torch.device) -> SdpaMetadata:
        lengths = list(layout.query_lens)
        starts = [0, *itertools.accumulate(lengths)][:-1]
        singles, packed_groups = [], []
        for members in _group_by_length(lengths, PACKED_GROUP_MIN_FILL, min_seqs=1):
            if len(members) == 1:
                singles.append(PrefillSegment(starts[members[0]], lengths[members[0]], None, None))
            else:
                group_starts = [starts[i] for i in members]
                group_lens = [lengths[i] for i in members]
                packed_groups.append(_packed_group(group_starts, group_lens, layout.causal, device))
        return SdpaMetadata(None, (), tuple(singles), layout.causal, tuple(packed_groups))

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_layer: KVLayer | None,
        metadata: SdpaMetadata,
    ) -> torch.Tensor:
        if kv_layer is not None:
            assert metadata.slot_mapping is not None, "built from a layout with page tables"
            kv_layer.write(metadata.slot_mapping, k, v)
        elif metadata.decode_chunks or metadata.cascade is not None:
            raise ValueError("decodes read keys and values from the KV cache: none was given")
        out = torch.empty_like(q)
        for chunk in metadata.decode_chunks:
            assert kv_layer is not None
            attn, _ = chunk_attention(q.index_select(0, chunk.rows), kv_layer, chunk)
            out.index_copy_(0, chunk.rows, attn)
        if metadata.cascade is not None:
            assert kv_layer is not None
            cascade_attention(q, kv_layer, metadata.cascade, out)
        for group in metadata.packed_groups:
            out.index_copy_(0, group.out_rows, _packed(q, k, v, group))
        for seg in metadata.prefills:
            rows = slice(seg.token_start, seg.token_start + seg.query_len)
            if seg.context_slots is None:
                keys, values = k[rows], v[rows]
            else:
                assert kv_layer is not None, "cached context is read from the KV cache"
                keys = kv_layer.keys.index_select(0, seg.context_slots)
                values = kv_layer.values.index_select(0, seg.context_slots)
            out[rows] = self._prefill_attention(q[rows], keys, values, seg.mask, metadata.causal)
        return out

    def _prefill_attention(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor | None,
        causal: bool,
    ) -> torch.Tensor:
        """One sequence's queries (its last tokens) over its keys; `mask` is the offset causal
        mask when there are more keys than queries."""
        if causal and use_blocked_prefill(q, keys.shape[0]):
            return blocked_causal_attention(q, keys, values)
        # [tokens, heads, dim] -> [1, heads, tokens, dim]
        attn = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None and causal,
            enable_gqa=True,
        )
        return attn.squeeze(0).transpose(0, 1)


def _packed_group(
    starts: list[int], lengths: list[int], causal: bool, device: torch.device
) -> PackedGroup:
    longest = max(lengths)
    slot_positions = torch.arange(longest)
    real = slot_positions < torch.tensor(lengths).unsqueeze(1)  # [seqs, longest]
    rows = torch.tensor(starts).unsqueeze(1) + slot_positions
    gather_rows = torch.where(real, rows, torch.zeros_like(rows)).flatten()
    mask = real[:, None, None, :].expand(-1, 1, longest, -1)
    if causal:
        # Padded query rows still see the real keys before them, so no row is fully masked.
        mask = mask & (slot_positions.unsqueeze(0) <= slot_positions.unsqueeze(1))
    real_slots = real.flatten().nonzero().squeeze(1)
    return PackedGroup(
        gather_rows=gather_rows.to(device),
        num_seqs=len(lengths),
        longest=longest,
        mask=mask.contiguous().to(device),
        real_slots=real_slots.to(device),
        out_rows=rows.flatten()[real_slots].to(device),
    )


def _packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: PackedGroup) -> torch.Tensor:
    """Attention of a group of whole sequences, padded to [seqs, heads, longest, head_dim]."""

    def padded(x: torch.Tensor) -> torch.Tensor:
        rows = x.index_select(0, group.gather_rows)
        return rows.view(group.num_seqs, group.longest, *x.shape[1:]).transpose(1, 2)

    attn = F.scaled_dot_product_attention(
        padded(q), padded(k), padded(v), attn_mask=group.mask, enable_gqa=True
    )
    flat = attn.transpose(1, 2).reshape(-1, *q.shape[1:])
    return flat.index_select(0, group.real_slots)
