"""Portable attention on torch's scaled_dot_product_attention, for CPU and CUDA alike.

Decodes (one query token each) run as one batched SDPA call over their pages, gathered into a
[batch, kv_heads, longest_context, head_dim] view with a length mask. Grouped-query heads are
folded into the query-length axis, so keys and values are never repeated per query head.
Prefill segments run one SDPA call each: causal over their own tokens, or over the gathered
pages with an offset causal mask when earlier chunks of the sequence are already cached.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vacpack.attention.backend import AttentionBackend, BatchLayout, register_backend
from vacpack.kvcache.paged_cache import KVLayer


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
    num_decodes: int
    decode_slots: torch.Tensor | None  # [num_decodes, longest_context]
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, longest_context]; None if all equal
    prefills: tuple[PrefillSegment, ...]


def _context_slots(pages: torch.Tensor, page_size: int, num_tokens: int) -> torch.Tensor:
    offsets = torch.arange(page_size, dtype=torch.int64)
    return (pages.unsqueeze(-1) * page_size + offsets).flatten(-2)[..., :num_tokens]


class TorchSdpaBackend(AttentionBackend):
    name = "torch_sdpa"

    def build_metadata(self, layout: BatchLayout, device: torch.device) -> SdpaMetadata:
        has_cache = bool(layout.page_tables)
        page_size = layout.page_size
        slot_mapping = None
        if has_cache:
            slot_chunks = []
            for query_len, context_len, pages in zip(
                layout.query_lens, layout.context_lens, layout.page_tables, strict=True
            ):
                positions = torch.arange(context_len - query_len, context_len)
                page_ids = torch.tensor(pages, dtype=torch.int64)[positions // page_size]
                slot_chunks.append(page_ids * page_size + positions % page_size)
            slot_mapping = torch.cat(slot_chunks).to(device, non_blocking=True)

        num_decodes = layout.num_decodes if has_cache else 0
        decode_slots = decode_mask = None
        if num_decodes:
            context_lens = torch.tensor(layout.context_lens[:num_decodes])
            longest = int(context_lens.max())
            num_pages = -(-longest // page_size)
            page_table = torch.zeros(num_decodes, num_pages, dtype=torch.int64)
            for row, pages in enumerate(layout.page_tables[:num_decodes]):
                used = pages[:num_pages]
                page_table[row, : len(used)] = torch.tensor(used, dtype=torch.int64)
            decode_slots = _context_slots(page_table, page_size, longest).to(device)
            if int(context_lens.min()) != longest:
                mask = torch.arange(longest) < context_lens.unsqueeze(1)
                decode_mask = mask[:, None, None, :].to(device)

        prefills = []
        token_start = sum(layout.query_lens[:num_decodes])
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
        return SdpaMetadata(slot_mapping, num_decodes, decode_slots, decode_mask, tuple(prefills))

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_layer: KVLayer | None,
        metadata: SdpaMetadata,
    ) -> torch.Tensor:
        if kv_layer is not None:
            kv_layer.write(metadata.slot_mapping, k, v)
        out = torch.empty_like(q)
        if metadata.num_decodes:
            n = metadata.num_decodes
            out[:n] = _decode(q[:n], kv_layer, metadata.decode_slots, metadata.decode_mask)
        for seg in metadata.prefills:
            rows = slice(seg.token_start, seg.token_start + seg.query_len)
            if seg.context_slots is None:
                keys, values = k[rows], v[rows]
            else:
                keys = kv_layer.keys.index_select(0, seg.context_slots)
                values = kv_layer.values.index_select(0, seg.context_slots)
            # [tokens, heads, dim] -> [1, heads, tokens, dim]
            attn = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1).unsqueeze(0),
                keys.transpose(0, 1).unsqueeze(0),
                values.transpose(0, 1).unsqueeze(0),
                attn_mask=seg.mask,
                is_causal=seg.mask is None,
                enable_gqa=True,
            )
            out[rows] = attn.squeeze(0).transpose(0, 1)
        return out


def _decode(
    q: torch.Tensor, kv_layer: KVLayer, slots: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = kv_layer.keys.shape[1]
    group = num_heads // num_kv_heads
    longest = slots.shape[1]
    flat_slots = slots.reshape(-1)
    keys = kv_layer.keys.index_select(0, flat_slots).view(num_seqs, longest, num_kv_heads, -1)
    values = kv_layer.values.index_select(0, flat_slots).view(num_seqs, longest, num_kv_heads, -1)
    # Query heads of one KV group become that group's "query positions": [seqs, kv_heads, group, dim].
    grouped_q = q.view(num_seqs, num_kv_heads, group, head_dim)
    attn = F.scaled_dot_product_attention(
        grouped_q, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask
    )
    return attn.reshape(num_seqs, num_heads, head_dim)


register_backend(TorchSdpaBackend.name, TorchSdpaBackend)
