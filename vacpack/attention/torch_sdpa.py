"""Portable attention in plain PyTorch, for CPU and CUDA alike.

Decodes (one query token each) run in chunks of similar context length, as paged matmuls,
through SDPA's kernel, or through a C kernel that reads the pages in place, whichever was
measured fastest at the model's decode step (paged_decode.py); decodes whose page tables start
with the same pages (a cached prefix) attend to that prefix together, once, and to their own
pages apart (cascade.py). Grouped-query heads are folded into the query rows, so keys and values
are never repeated per query head. Prefill segments run one SDPA call each: causal over their
own tokens, or over their gathered pages with an offset causal mask when earlier chunks of the
sequence are already cached; long segments run as blocked matmuls instead where those were
measured faster at the model's shapes (blocked_prefill.py; when nothing was measured, long bf16
segments on a CPU).

Sliding-window layers get their own view of the step (`attention_windows` in the layout): a
decode gathers only the pages its window reaches, with the keys before the window masked; a
prefill segment longer than its window runs as blocked matmuls that skip the keys no query of
a block sees; decodes never cascade there (a shared prefix is mostly outside the window).
Soft-capped scores (Gemma 2), which SDPA cannot apply, also run as blocked matmuls.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vacpack.attention.backend import (
    FULL_ATTENTION,
    AttentionBackend,
    AttentionSpec,
    BatchLayout,
)
from vacpack.attention.blocked_prefill import blocked_causal_attention, use_blocked_prefill
from vacpack.attention.cascade import (
    DEFAULT_CASCADE_POLICY,
    PREFIX_FORMS,
    CascadePlan,
    CascadePolicy,
    cascade_attention,
    cascade_group,
)
from vacpack.attention.packed_groups import PackedGroup, packed_attention, packed_group
from vacpack.attention.paged_decode import (
    DECODE_FORMS,
    DecodeChunk,
    build_chunks,
    chunk_attention,
)
from vacpack.attention.shared_prefix import shared_decode_prefixes
from vacpack.kvcache.paged_cache import KVLayer

# Whole short sequences of a packed bin (no KV cache) run the same way, padded to the longest
# of their group: one SDPA call for many embedding-sized documents instead of one each.
PACKED_GROUP_MIN_FILL = 0.7


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
    """What the layers of one kind (one sliding window, or full attention) read in a step."""

    slot_mapping: torch.Tensor | None  # [num_tokens] where each token's k and v are written
    decode_chunks: tuple[DecodeChunk, ...]  # decodes without a shared prefix
    prefills: tuple[PrefillSegment, ...]
    causal: bool = True
    packed_groups: tuple[PackedGroup, ...] = ()
    cascade: CascadePlan | None = None  # decodes with one
    window: int | None = None  # the sliding window this view was built for

    def view(self, window: int | None) -> SdpaMetadata:
        if window != self.window:
            raise _missing_view(window, (self.window,))
        return self


@dataclass(frozen=True)
class SdpaWindowedMetadata:
    """A step of a model whose layers attend over different windows: one view per window."""

    views: Mapping[int | None, SdpaMetadata]

    def view(self, window: int | None) -> SdpaMetadata:
        if window not in self.views:
            raise _missing_view(window, tuple(self.views))
        return self.views[window]


def _missing_view(window: int | None, built: tuple[int | None, ...]) -> ValueError:
    return ValueError(
        f"the step's attention metadata was built for windows {built}, not for a layer with "
        f"window {window}: build its BatchLayout with the model's attention_windows"
    )


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


def _windowed_decode_chunks(
    layout: BatchLayout, window: int, device: torch.device, form: str
) -> tuple[DecodeChunk, ...]:
    """Chunks for the decodes of a sliding-window layer: each gathers its pages from the one
    holding the first key of its window on, and masks the keys before that key."""
    page_size = layout.page_size
    runs, num_keys, num_hidden = [], [], []
    for context_len, pages in zip(
        layout.context_lens[: layout.num_decodes],
        layout.page_tables[: layout.num_decodes],
        strict=True,
    ):
        first_key = max(0, context_len - window)
        first_page = first_key // page_size
        runs.append(pages[first_page:])
        num_keys.append(context_len - first_page * page_size)
        num_hidden.append(first_key - first_page * page_size)
    rows = range(layout.num_decodes)
    return build_chunks(rows, runs, num_keys, page_size, device, form, num_hidden)


def _decode_metadata(
    layout: BatchLayout,
    policy: CascadePolicy | None,
    device: torch.device,
    form: str,
    prefix_form: str,
) -> tuple[tuple[DecodeChunk, ...], CascadePlan | None]:
    """Chunks for the decodes (the first layout.num_decodes sequences, one stream row each) in
    decode form `form`, and the cascade for those among them that share a long enough prefix
    of pages, its prefixes in `prefix_form` (cascade.PREFIX_FORMS)."""
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
        runs = [page_tables[i][shared_pages[i] :] for i in indices]
        return build_chunks(indices, runs, num_keys, page_size, device, form)

    plain = [i for i in range(num_decodes) if shared_pages[i] == 0]
    if not prefixes:
        return chunks(plain), None
    groups = tuple(
        cascade_group(
            list(prefix.members),
            list(page_tables[prefix.members[0]][: prefix.num_pages]),
            page_size,
            device,
            prefix_form,
        )
        for prefix in prefixes
    )
    members = [i for i in range(num_decodes) if shared_pages[i] > 0]
    return chunks(plain), CascadePlan(groups, chunks(members))


class TorchSdpaBackend(AttentionBackend):
    name = "torch_sdpa"

    def __init__(
        self,
        cascade: CascadePolicy | None = DEFAULT_CASCADE_POLICY,
        blocked_prefill: bool | None = None,
        decode_form: str = "matmuls",
        prefix_form: str = "matmuls",
    ) -> None:
        self.cascade = cascade  # None: every decode reads its whole context itself
        # Long causal prefills as blocked matmuls (True) or SDPA (False), as measured at the
        # model's shapes; None: blocked for bf16 on a CPU (use_blocked_prefill).
        self.blocked_prefill = blocked_prefill
        # Decodes as plain matmuls (where nothing was measured), through SDPA's kernel, or
        # through the C kernel, as measured at the model's decode step (paged_decode.py).
        if decode_form not in DECODE_FORMS:
            raise ValueError(f"decode_form must be one of {DECODE_FORMS}, got {decode_form!r}")
        self.decode_form = decode_form
        # A cascade's shared prefixes as matmuls or through the C varlen kernel, as measured
        # (cascade.py).
        if prefix_form not in PREFIX_FORMS:
            raise ValueError(f"prefix_form must be one of {PREFIX_FORMS}, got {prefix_form!r}")
        self.prefix_form = prefix_form

    def unsupported(self, spec: AttentionSpec) -> str | None:
        return None  # every window, scale and softcap

    def build_metadata(
        self, layout: BatchLayout, device: torch.device
    ) -> SdpaMetadata | SdpaWindowedMetadata:
        windows = layout.attention_windows
        slot_mapping = None
        if layout.page_tables:
            slot_mapping = build_slot_mapping(layout).to(device, non_blocking=True)
        if windows == (None,):
            return self._view(layout, None, slot_mapping, device)
        return SdpaWindowedMetadata(
            {window: self._view(layout, window, slot_mapping, device) for window in windows}
        )

    def _view(
        self,
        layout: BatchLayout,
        window: int | None,
        slot_mapping: torch.Tensor | None,
        device: torch.device,
    ) -> SdpaMetadata:
        if not layout.page_tables:
            return self._prefill_only_metadata(layout, window, device)
        page_size = layout.page_size
        num_decodes = layout.num_decodes
        if window is None:
            decode_chunks, cascade = _decode_metadata(
                layout, self.cascade, device, self.decode_form, self.prefix_form
            )
        else:
            decode_chunks = _windowed_decode_chunks(layout, window, device, self.decode_form)
            cascade = None
        prefills = []
        token_start = num_decodes  # decodes come first, one token each
        for i in range(num_decodes, len(layout.query_lens)):
            query_len, context_len = layout.query_lens[i], layout.context_lens[i]
            # Keys from the first one the segment's first query sees.
            key_start = 0 if window is None else max(0, context_len - query_len - window + 1)
            num_keys = context_len - key_start
            context_slots = mask = None
            if num_keys > query_len:
                pages = torch.tensor(layout.page_tables[i], dtype=torch.int64)
                slots = _context_slots(pages, page_size, context_len)[key_start:]
                context_slots = slots.to(device)
            if num_keys > query_len and (window is None or num_keys <= window):
                # Past its window a segment runs blocked (see forward), which needs no mask.
                query_positions = torch.arange(num_keys - query_len, num_keys)
                mask = (torch.arange(num_keys) <= query_positions.unsqueeze(1)).to(device)
            prefills.append(PrefillSegment(token_start, query_len, context_slots, mask))
            token_start += query_len
        return SdpaMetadata(
            slot_mapping, decode_chunks, tuple(prefills), cascade=cascade, window=window
        )

    @staticmethod
    def _prefill_only_metadata(
        layout: BatchLayout, window: int | None, device: torch.device
    ) -> SdpaMetadata:
        lengths = list(layout.query_lens)
        starts = [0, *itertools.accumulate(lengths)][:-1]
        singles, packed_groups = [], []
        for members in _group_by_length(lengths, PACKED_GROUP_MIN_FILL, min_seqs=1):
            if len(members) == 1:
                singles.append(PrefillSegment(starts[members[0]], lengths[members[0]], None, None))
            else:
                group_starts = [starts[i] for i in members]
                group_lens = [lengths[i] for i in members]
                packed_groups.append(
                    packed_group(group_starts, group_lens, layout.causal, device, window)
                )
        return SdpaMetadata(
            None, (), tuple(singles), layout.causal, tuple(packed_groups), window=window
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_layer: KVLayer | None,
        metadata: SdpaMetadata | SdpaWindowedMetadata,
        spec: AttentionSpec = FULL_ATTENTION,
    ) -> torch.Tensor:
        view = metadata.view(spec.sliding_window)
        if kv_layer is not None:
            assert view.slot_mapping is not None, "built from a layout with page tables"
            kv_layer.write(view.slot_mapping, k, v)
        elif view.decode_chunks or view.cascade is not None:
            raise ValueError("decodes read keys and values from the KV cache: none was given")
        out = torch.empty_like(q)
        for chunk in view.decode_chunks:
            assert kv_layer is not None
            attn, _ = chunk_attention(
                q.index_select(0, chunk.rows), kv_layer, chunk, spec=spec, form=self.decode_form
            )
            out.index_copy_(0, chunk.rows, attn)
        if view.cascade is not None:
            assert kv_layer is not None
            cascade_attention(q, kv_layer, view.cascade, out, spec, self.decode_form)
        for group in view.packed_groups:
            out.index_copy_(0, group.out_rows, packed_attention(q, k, v, group, spec))
        for seg in view.prefills:
            rows = slice(seg.token_start, seg.token_start + seg.query_len)
            if seg.context_slots is None:
                keys, values = k[rows], v[rows]
            else:
                assert kv_layer is not None, "cached context is read from the KV cache"
                keys, values = kv_layer.read(seg.context_slots, q.dtype)
            out[rows] = _prefill_attention(
                q[rows], keys, values, seg.mask, view.causal, spec, self.blocked_prefill
            )
        return out


def _prefill_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    spec: AttentionSpec,
    blocked_prefill: bool | None = None,
) -> torch.Tensor:
    """One sequence's queries (its last tokens) over its keys; `mask` is the offset causal
    mask when there are more keys than queries."""
    window, softcap = spec.sliding_window, spec.logit_softcap
    if not causal and (window is not None or softcap is not None):
        raise ValueError("bidirectional attention takes neither a sliding window nor a softcap")
    windowed = window is not None and keys.shape[0] > window
    blocked = use_blocked_prefill(q, keys.shape[0], blocked_prefill)
    if causal and (windowed or softcap is not None or blocked):
        return blocked_causal_attention(q, keys, values, spec.scale, window, softcap)
    # [tokens, heads, dim] -> [1, heads, tokens, dim]
    attn = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        keys.transpose(0, 1).unsqueeze(0),
        values.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=mask is None and causal,
        enable_gqa=True,
        scale=spec.scale,
    )
    return attn.squeeze(0).transpose(0, 1)
