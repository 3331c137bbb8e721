"""The CUDA attention backend: our Triton kernel over the paged cache, a varlen kernel without one.

Steps with a KV cache write this step's keys and values into their slots, then run the paged
kernel of `triton_paged` twice at most: once over the leading decodes (one query token each,
split-KV when there are too few of them to fill the device) and once over the prefill chunks.
Steps without a KV cache (packed bins of whole sequences) run a FlashAttention varlen kernel,
PyTorch's own when it has one, else the flash-attn package's; with neither, or for a dtype or
head size those kernels refuse, the portable backend runs them.

Decode steps can also run from `TritonDecodeGraphBuffers`, static tensors that a captured CUDA
graph reads (see `DecodeGraphBuffers`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vacpack.attention.backend import (
    FULL_ATTENTION,
    AttentionBackend,
    AttentionSpec,
    BatchLayout,
    DecodeGraphBuffers,
)
from vacpack.attention.page_tables import padded_page_table, used_pages
from vacpack.attention.torch_sdpa import TorchSdpaBackend
from vacpack.attention.triton_paged import decode_config, paged_attention, prefill_config
from vacpack.kvcache.paged_cache import KVLayer

# Split-KV decode: aim for this many programs per multiprocessor, give each split at least
# MIN_TOKENS_PER_SPLIT keys (fewer would cost more in the merge than they save), and cap the
# splits (the partial results grow with them).
PROGRAMS_PER_MULTIPROCESSOR = 2
MIN_TOKENS_PER_SPLIT = 256
MAX_KV_SPLITS = 16

# FlashAttention's varlen kernels: half precision, head sizes a multiple of 8 up to 256, on
# Ampere (compute capability 8.0) or newer.
VARLEN_DTYPES = (torch.float16, torch.bfloat16)
VARLEN_MAX_HEAD_DIM = 256
VARLEN_MIN_CAPABILITY = (8, 0)

INT32_PER_16_BYTES = 4  # Triton's pointer specialization looks at 16-byte alignment

# (q, k, v, cu_seqlens, max_seq_len, causal, spec) -> attention output shaped like q; the spec
# has no softcap (those layers run on the portable backend).
VarlenAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, bool, AttentionSpec],
    torch.Tensor,
]


def _flash_window(causal: bool, spec: AttentionSpec) -> tuple[int, int]:
    """FlashAttention's (left, right) window: keys from i - left to i + right; -1 unbounded."""
    if not causal:
        return (-1, -1)
    return (-1 if spec.sliding_window is None else spec.sliding_window - 1, 0)


@dataclass(frozen=True)
class TritonPagedMetadata:
    """A step over the paged cache: sequences [0, num_decodes) have one query token each."""

    slot_mapping: torch.Tensor  # int64 [num_tokens] where each token's keys and values go
    cu_seqlens_q: torch.Tensor  # int32 [num_seqs + 1] query row boundaries
    context_lens: torch.Tensor  # int32 [num_seqs] cached tokens after this step
    page_table: torch.Tensor  # int32 [num_seqs, max_pages]
    num_decodes: int
    num_seqs: int
    max_prefill_query_len: int  # 0 when there are no prefill chunks
    max_context_len: int  # an upper bound, for choosing the decode's split-KV count


@dataclass(frozen=True)
class VarlenMetadata:
    """A packed bin of whole sequences without a KV cache."""

    cu_seqlens: torch.Tensor  # int32 [num_seqs + 1] on the device
    max_seq_len: int
    causal: bool
    layout: BatchLayout  # for the portable backend, when the varlen kernel refuses the inputs


def find_varlen_attention() -> VarlenAttention | None:
    """PyTorch's varlen FlashAttention when this torch has it (with GQA), else flash-attn's."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        varlen_attn = None  # type: ignore[assignment]
    # Earlier torch releases had varlen_attn without grouped-query heads or causal windows.
    if varlen_attn is not None and {"enable_gqa", "window_size", "scale"} <= set(
        inspect.signature(varlen_attn).parameters
    ):

        def torch_varlen(
            q: torch.Tensor,
            k: torch.Tensor,
            v: torch.Tensor,
            cu_seqlens: torch.Tensor,
            max_seq_len: int,
            causal: bool,
            spec: AttentionSpec,
        ) -> torch.Tensor:
            out = varlen_attn(
                q, k, v, cu_seqlens, cu_seqlens, max_seq_len, max_seq_len,
                window_size=_flash_window(causal, spec), enable_gqa=True, scale=spec.scale,
            )  # fmt: skip
            assert isinstance(out, torch.Tensor)  # no return_aux asked for: the output alone
            return out

        return torch_varlen
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None

    def flash_attn_varlen(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seq_len: int,
        causal: bool,
        spec: AttentionSpec,
    ) -> torch.Tensor:
        return flash_attn_varlen_func(
            q, k, v, cu_seqlens, cu_seqlens, max_seq_len, max_seq_len, causal=causal,
            softmax_scale=spec.scale, window_size=_flash_window(causal, spec),
        )  # fmt: skip

    return flash_attn_varlen


@functools.cache
def _multiprocessor_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _num_kv_splits(
    num_decodes: int, num_kv_heads: int, max_context_len: int, q: torch.Tensor
) -> int:
    if not q.is_cuda:
        return 1
    target_programs = PROGRAMS_PER_MULTIPROCESSOR * _multiprocessor_count(q.device.index or 0)
    programs = num_decodes * num_kv_heads
    splits = min(
        MAX_KV_SPLITS,
        -(-target_programs // programs),
        -(-max_context_len // MIN_TOKENS_PER_SPLIT),
    )
    return max(1, splits)


def _aligned_starts(lengths: Sequence[int], alignment: int) -> list[int]:
    """Where each of consecutive parts of these lengths starts, every start a multiple of
    `alignment`, and last the total length."""
    starts = [0]
    for length in lengths:
        starts.append(-(-(starts[-1] + length) // alignment) * alignment)
    return starts


class TritonBackend(AttentionBackend):
    name = "triton"

    def __init__(self) -> None:
        self._portable = TorchSdpaBackend()
        self._varlen = find_varlen_attention()

    def unsupported(self, spec: AttentionSpec) -> str | None:
        return None  # the paged kernel takes every window, scale and softcap

    def build_metadata(self, layout: BatchLayout, device: torch.device) -> Any:
        if layout.page_tables:
            return self._paged_metadata(layout, device)
        if (
            self._varlen is not None
            and device.type == "cuda"
            and torch.cuda.get_device_capability(device) >= VARLEN_MIN_CAPABILITY
        ):
            lengths = torch.tensor(layout.query_lens, dtype=torch.int32)
            cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
            return VarlenMetadata(
                cu_seqlens.to(device, non_blocking=True),
                max(layout.query_lens),
                layout.causal,
                layout,
            )
        return self._portable.build_metadata(layout, device)

    @staticmethod
    def _paged_metadata(layout: BatchLayout, device: torch.device) -> TritonPagedMetadata:
        page_size = layout.page_size
        num_seqs = len(layout.query_lens)
        query_lens = torch.tensor(layout.query_lens, dtype=torch.int32)
        context_lens = torch.tensor(layout.context_lens, dtype=torch.int32)
        cu_seqlens_q = torch.nn.functional.pad(query_lens.cumsum(0, dtype=torch.int32), (1, 0))
        page_table = padded_page_table(used_pages(layout), fill_page=0)

        token_seq = torch.repeat_interleave(torch.arange(num_seqs), query_lens)
        first_position = (context_lens - query_lens).long()
        positions = (
            torch.arange(layout.num_tokens) - cu_seqlens_q[token_seq] + first_position[token_seq]
        )
        pages = page_table[token_seq, positions // page_size].long()
        slot_mapping = pages * page_size + positions % page_size

        # The int32 tensors travel to the device as one copy, each starting 16-byte aligned:
        # Triton specializes its kernels on pointer alignment, and views at varying offsets
        # would compile a new variant whenever the number of sequences changes.
        parts = [cu_seqlens_q, context_lens, page_table.flatten()]
        starts = _aligned_starts([len(part) for part in parts], INT32_PER_16_BYTES)
        packed = torch.zeros(starts[-1], dtype=torch.int32)
        for part, start in zip(parts, starts[:-1], strict=True):
            packed[start : start + len(part)] = part
        packed = packed.to(device, non_blocking=True)
        num_decodes = 0  # the leading run of one-token sequences
        while num_decodes < num_seqs and layout.query_lens[num_decodes] == 1:
            num_decodes += 1
        return TritonPagedMetadata(
            slot_mapping=slot_mapping.to(device, non_blocking=True),
            cu_seqlens_q=packed[: num_seqs + 1],
            context_lens=packed[starts[1] : starts[1] + num_seqs],
            page_table=packed[starts[2] : starts[2] + page_table.numel()].view(page_table.shape),
            num_decodes=num_decodes,
            num_seqs=num_seqs,
            max_prefill_query_len=max(layout.query_lens[num_decodes:], default=0),
            max_context_len=max(layout.context_lens),
        )

    def make_decode_graph_buffers(
        self, max_num_seqs: int, max_pages_per_seq: int, page_size: int, device: torch.device
    ) -> TritonDecodeGraphBuffers:
        return TritonDecodeGraphBuffers(max_num_seqs, max_pages_per_seq, page_size, device)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_layer: KVLayer | None,
        metadata: Any,
        spec: AttentionSpec = FULL_ATTENTION,
    ) -> torch.Tensor:
        if isinstance(metadata, TritonPagedMetadata):
            assert kv_layer is not None, "a paged step needs its KV layer"
            return _paged_forward(q, k, v, kv_layer, metadata, spec)
        if isinstance(metadata, VarlenMetadata):
            return self._varlen_forward(q, k, v, metadata, spec)
        return self._portable.forward(q, k, v, kv_layer, metadata, spec)

    def _varlen_forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        metadata: VarlenMetadata,
        spec: AttentionSpec,
    ) -> torch.Tensor:
        head_dim = q.shape[-1]
        if (
            q.dtype in VARLEN_DTYPES
            and head_dim % 8 == 0
            and head_dim <= VARLEN_MAX_HEAD_DIM
            and spec.logit_softcap is None
        ):
            assert self._varlen is not None
            return self._varlen(
                q, k, v, metadata.cu_seqlens, metadata.max_seq_len, metadata.causal, spec
            )
        # Rare (a float32 model on CUDA, soft-capped scores): the portable metadata is built per
        # layer here rather than for every packed step that never needs it.
        portable = self._portable.build_metadata(metadata.layout, q.device)
        return self._portable.forward(q, k, v, None, portable, spec)


def _paged_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_layer: KVLayer,
    metadata: TritonPagedMetadata,
    spec: AttentionSpec,
) -> torch.Tensor:
    kv_layer.write(metadata.slot_mapping, k, v)
    out = torch.empty_like(q)
    num_kv_heads = kv_layer.num_kv_heads
    head_group, head_dim = q.shape[1] // num_kv_heads, q.shape[2]
    common: dict[str, Any] = {
        "out": out,
        "q": q,
        "keys": kv_layer.key_rows(),
        "values": kv_layer.values,
        "cu_seqlens_q": metadata.cu_seqlens_q,
        "context_lens": metadata.context_lens,
        "page_table": metadata.page_table,
        "page_size": kv_layer.page_size,
        "scale": spec.scale_for(head_dim),
        "window": spec.sliding_window,
        "softcap": spec.logit_softcap,
    }
    if metadata.num_decodes:
        paged_attention(
            **common,
            first_seq=0,
            num_seqs=metadata.num_decodes,
            max_query_len=1,
            config=decode_config(head_group, head_dim),
            num_kv_splits=_num_kv_splits(
                metadata.num_decodes, num_kv_heads, metadata.max_context_len, q
            ),
        )
    if metadata.num_seqs > metadata.num_decodes:
        paged_attention(
            **common,
            first_seq=metadata.num_decodes,
            num_seqs=metadata.num_seqs - metadata.num_decodes,
            max_query_len=metadata.max_prefill_query_len,
            config=prefill_config(head_group, head_dim),
        )
    return out


class TritonDecodeGraphBuffers(DecodeGraphBuffers):
    def __init__(
        self, max_num_seqs: int, max_pages_per_seq: int, page_size: int, device: torch.device
    ) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_pages_per_seq = max_pages_per_seq
        self.page_size = page_size
        self.slot_mapping = torch.zeros(max_num_seqs, dtype=torch.int64, device=device)
        # One query token per row, always: the boundaries never change.
        self.cu_seqlens_q = torch.arange(max_num_seqs + 1, dtype=torch.int32, device=device)
        self.context_lens = torch.ones(max_num_seqs, dtype=torch.int32, device=device)
        self.page_table = torch.zeros(
            max_num_seqs, max_pages_per_seq, dtype=torch.int32, device=device
        )

    def metadata(self, num_seqs: int) -> TritonPagedMetadata:
        return TritonPagedMetadata(
            slot_mapping=self.slot_mapping[:num_seqs],
            cu_seqlens_q=self.cu_seqlens_q[: num_seqs + 1],
            context_lens=self.context_lens[:num_seqs],
            page_table=self.page_table[:num_seqs],
            num_decodes=num_seqs,
            num_seqs=num_seqs,
            max_prefill_query_len=0,
            # The bound the buffers allow, so a batch size always gets the same split count.
            max_context_len=self.max_pages_per_seq * self.page_size,
        )

    def fill(self, layout: BatchLayout, num_seqs: int, scratch_page: int) -> None:
        num_real = len(layout.query_lens)
        if num_real > num_seqs or num_seqs > self.max_num_seqs:
            raise ValueError(f"{num_real} sequences in {num_seqs} rows of {self.max_num_seqs}")
        if layout.num_tokens != num_real:
            raise ValueError("graph buffers hold decode-only steps (one query token a sequence)")
        num_padding = num_seqs - num_real
        tables = [*used_pages(layout), *[[scratch_page]] * num_padding]
        page_table = padded_page_table(tables, fill_page=scratch_page)
        if page_table.shape[1] > self.max_pages_per_seq:
            raise ValueError(
                f"a context of {page_table.shape[1]} pages exceeds the buffers' "
                f"{self.max_pages_per_seq}"
            )
        context_lens = torch.tensor([*layout.context_lens, *[1] * num_padding], dtype=torch.int32)
        last_positions = context_lens.long() - 1
        pages = page_table[torch.arange(num_seqs), last_positions // self.page_size].long()
        # Only the columns in use are copied; the kernel never reads past a row's context.
        self.page_table[:num_seqs, : page_table.shape[1]].copy_(page_table, non_blocking=True)
        self.context_lens[:num_seqs].copy_(context_lens, non_blocking=True)
        self.slot_mapping[:num_seqs].copy_(
            pages * self.page_size + last_positions % self.page_size, non_blocking=True
        )
