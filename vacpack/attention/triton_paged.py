"""Paged attention in Triton, reading the page table directly: ragged decodes and prefill chunks.

One program handles one KV head of a block of query tokens of one sequence. Its query tile
stacks every query head that shares that KV head (grouped-query attention), so each key and
value tile is loaded once for the whole head group: tile row r is query token r // head_group,
query head kv_head * head_group + r % head_group. The keys are walked in tiles of token
positions; each position's slot comes from the sequence's page table, so pages are never
gathered into a contiguous copy. Softmax is online (running max and sum) in float32.

Query token i of a sequence with query_len tokens and context_len cached tokens (this step's
included) sits at position context_len - query_len + i and sees keys at positions <= its own;
with a sliding window of W tokens only those > its position - W, and the program's walk over
the keys starts at the first key its first query sees, so pages before every window (which the
scheduler may have given back) are never read. Scores may be soft-capped (Gemma 2):
cap * tanh(score / cap), before the softmax.

Decodes with few sequences leave most of the device idle, so a decode launch may split each
sequence's keys into `num_kv_splits` ranges (flash-decoding): each range writes a partial
result and its log-sum-exp, and a second kernel merges them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class PagedKernelConfig:
    block_rows: int  # query tile rows: query tokens x heads of one KV group, a power of two
    tokens_per_block: int  # query tokens per program
    block_kv_tokens: int  # key positions per tile, a power of two
    num_warps: int = 4
    num_stages: int = 2


# tl.dot needs every tile side >= 16 on the GPU.
MIN_TILE = 16
# A prefill program's query rows: enough to fill the tensor cores, few enough that the float32
# accumulator [rows, head_dim] stays in registers for head_dim up to 256.
PREFILL_ROWS = 64
KV_TILE_TOKENS = 64
# Heads of 128+ dims make a [rows, head_dim] accumulator and a [head_dim, kv tile] key tile
# heavy on registers; a shorter key tile keeps them from spilling.
LARGE_HEAD_DIM = 128
LARGE_HEAD_KV_TILE_TOKENS = 32


def decode_config(head_group: int, head_dim: int) -> PagedKernelConfig:
    """One query token per program: the tile is the head group, padded to a dot-sized tile."""
    return PagedKernelConfig(
        block_rows=max(MIN_TILE, triton.next_power_of_2(head_group)),
        tokens_per_block=1,
        block_kv_tokens=_kv_tile_tokens(head_dim),
    )


def prefill_config(head_group: int, head_dim: int) -> PagedKernelConfig:
    block_rows = max(PREFILL_ROWS, triton.next_power_of_2(head_group))
    return PagedKernelConfig(
        block_rows=block_rows,
        tokens_per_block=block_rows // head_group,
        block_kv_tokens=_kv_tile_tokens(head_dim),
    )


def _kv_tile_tokens(head_dim: int) -> int:
    return LARGE_HEAD_KV_TILE_TOKENS if head_dim > LARGE_HEAD_DIM else KV_TILE_TOKENS


# Triton compiles a variant per "specialization" of its integer arguments (equal to 1, divisible
# by 16). The first prefill sequence's index and the page table's row stride change from step
# to step, so specializing on them compiled up to four variants of this kernel during the first
# steps of a run (about 2 s each on an H100 with 128-dim heads); they gain nothing from it.
@triton.jit(do_not_specialize=["first_seq", "page_table_stride"])
def _paged_attention_kernel(
    out_ptr,
    q_ptr,
    keys_ptr,
    values_ptr,
    cu_seqlens_q_ptr,
    context_lens_ptr,
    page_table_ptr,
    partial_out_ptr,  # [tokens, heads, splits, HEAD_DIM_PADDED] float32; only with NUM_SPLITS > 1
    partial_lse_ptr,  # [tokens, heads, splits] float32, log2 domain; only with NUM_SPLITS > 1
    first_seq,
    scale,  # the factor on q . k
    softcap,  # scores -> softcap * tanh(scores / softcap); read only with SOFTCAP
    window,  # a query sees this many positions up to its own; read only with WINDOWED
    q_stride_token,
    q_stride_head,
    out_stride_token,
    out_stride_head,
    kv_stride_slot,
    kv_stride_head,
    page_table_stride,
    num_heads,
    HEAD_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    TOKENS_PER_BLOCK: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    LOG2_E: tl.constexpr = 1.4426950408889634
    seq = first_seq + tl.program_id(0)
    q_block = tl.program_id(1) // NUM_SPLITS
    split = tl.program_id(1) % NUM_SPLITS
    kv_head = tl.program_id(2)

    q_start = tl.load(cu_seqlens_q_ptr + seq)
    query_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    first_token = q_block * TOKENS_PER_BLOCK
    if first_token >= query_len:
        return  # the grid covers the longest query of the launch; shorter ones stop here
    context_len = tl.load(context_lens_ptr + seq)
    cached_len = context_len - query_len

    rows = tl.arange(0, BLOCK_ROWS)
    token = first_token + rows // HEAD_GROUP
    head = kv_head * HEAD_GROUP + rows % HEAD_GROUP
    row_valid = (rows < TOKENS_PER_BLOCK * HEAD_GROUP) & (token < query_len)
    position = cached_len + token
    dims = tl.arange(0, HEAD_DIM_PADDED)
    dim_valid = dims < HEAD_DIM

    q_offsets = (q_start + token)[:, None] * q_stride_token + head[:, None] * q_stride_head
    q = tl.load(q_ptr + q_offsets + dims[None, :], row_valid[:, None] & dim_valid[None, :], 0.0)

    # Causality: the block's last query token sees keys up to its own position, none after;
    # with a window its first query token sees none before its window.
    last_token = tl.minimum(first_token + TOKENS_PER_BLOCK, query_len) - 1
    kv_end = cached_len + last_token + 1
    kv_first = 0
    if WINDOWED:
        kv_first = tl.maximum(cached_len + first_token - window + 1, 0)
    split_len = tl.cdiv(tl.cdiv(kv_end - kv_first, NUM_SPLITS), BLOCK_KV) * BLOCK_KV
    kv_start = kv_first + split * split_len
    kv_stop = tl.minimum(kv_end, kv_start + split_len)

    row_max = tl.full([BLOCK_ROWS], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_ROWS], tl.float32)
    acc = tl.zeros([BLOCK_ROWS, HEAD_DIM_PADDED], tl.float32)
    page_row = page_table_ptr + seq.to(tl.int64) * page_table_stride
    for tile_start in range(kv_start, kv_stop, BLOCK_KV):
        kv_pos = tile_start + tl.arange(0, BLOCK_KV)
        kv_valid = kv_pos < kv_stop
        page = tl.load(page_row + kv_pos // PAGE_SIZE, kv_valid, 0).to(tl.int64)
        slot = page * PAGE_SIZE + kv_pos % PAGE_SIZE
        kv_offsets = slot * kv_stride_slot + kv_head * kv_stride_head
        keys_t = tl.load(
            keys_ptr + kv_offsets[None, :] + dims[:, None],
            kv_valid[None, :] & dim_valid[:, None],
            0.0,
        )
        if DOT_IN_FP32:
            scores = tl.dot(q.to(tl.float32), keys_t.to(tl.float32), input_precision="ieee")
        else:
            scores = tl.dot(q, keys_t)
        scores = scores * scale
        if SOFTCAP:
            # tanh(x) = 2 sigmoid(2x) - 1
            scores = softcap * (2.0 * tl.sigmoid(2.0 * scores / softcap) - 1.0)
        visible = (kv_pos[None, :] <= position[:, None]) & kv_valid[None, :]
        if WINDOWED:
            visible = visible & (kv_pos[None, :] > position[:, None] - window)
        scores = tl.where(visible, scores * LOG2_E, float("-inf"))

        new_max = tl.maximum(row_max, tl.max(scores, 1))
        # A row that has seen no visible key yet keeps a -inf max; exp2(-inf - -inf) would be
        # NaN, so such rows subtract 0 instead (their probabilities are exp2(-inf) = 0 anyway).
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        probs = tl.exp2(scores - safe_max[:, None])
        rescale = tl.exp2(row_max - safe_max)
        row_sum = row_sum * rescale + tl.sum(probs, 1)
        values = tl.load(
            values_ptr + kv_offsets[:, None] + dims[None, :],
            kv_valid[:, None] & dim_valid[None, :],
            0.0,
        )
        if DOT_IN_FP32:
            acc = acc * rescale[:, None] + tl.dot(
                probs, values.to(tl.float32), input_precision="ieee"
            )
        else:
            acc = acc * rescale[:, None] + tl.dot(probs.to(values.dtype), values)
        row_max = new_max

    out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
    if NUM_SPLITS == 1:
        out_rows = (q_start + token)[:, None] * out_stride_token + head[:, None] * out_stride_head
        tl.store(
            out_ptr + out_rows + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            row_valid[:, None] & dim_valid[None, :],
        )
    else:
        # An empty split (its range starts past the context) leaves lse = -inf: weight 0.
        empty = row_sum == 0.0
        lse = tl.where(empty, float("-inf"), row_max + tl.log2(tl.where(empty, 1.0, row_sum)))
        part_row = ((q_start + token) * num_heads + head) * NUM_SPLITS + split
        tl.store(partial_lse_ptr + part_row, lse, row_valid)
        tl.store(
            partial_out_ptr + part_row[:, None] * HEAD_DIM_PADDED + dims[None, :],
            out,
            row_valid[:, None],
        )


@triton.jit
def _merge_splits_kernel(
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    out_stride_token,
    out_stride_head,
    num_heads,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PADDED: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PADDED)
    dims = tl.arange(0, HEAD_DIM_PADDED)
    part_row = (token * num_heads + head) * NUM_SPLITS + splits
    lse = tl.load(partial_lse_ptr + part_row, splits < NUM_SPLITS, float("-inf"))
    # The first split is never empty (nor, with a window, the last): the max is finite.
    weights = tl.exp2(lse - tl.max(lse, 0))
    parts = tl.load(
        partial_out_ptr + part_row[:, None] * HEAD_DIM_PADDED + dims[None, :],
        (splits < NUM_SPLITS)[:, None],
        0.0,
    )
    out = tl.sum(parts * weights[:, None], 0) / tl.sum(weights, 0)
    tl.store(
        out_ptr + token * out_stride_token + head * out_stride_head + dims,
        out.to(out_ptr.dtype.element_ty),
        dims < HEAD_DIM,
    )


def paged_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    page_table: torch.Tensor,
    *,
    first_seq: int,
    num_seqs: int,
    max_query_len: int,
    page_size: int,
    scale: float,
    config: PagedKernelConfig,
    num_kv_splits: int = 1,
    window: int | None = None,
    softcap: float | None = None,
) -> None:
    """Writes the attention of sequences [first_seq, first_seq + num_seqs) into their rows of out.

    out, q: [num_tokens, num_heads, head_dim]; keys, values: [num_slots, num_kv_heads, head_dim];
    cu_seqlens_q: int32 [num_seqs_total + 1], the query tokens' row boundaries; context_lens:
    int32 [num_seqs_total], cached tokens after this step; page_table: int32
    [num_seqs_total, max_pages]. The keys and values of this step must already be in the cache.
    Split-KV (num_kv_splits > 1) needs one query token per sequence and first_seq 0. window: a
    sliding window in tokens (None: the whole context); softcap: see the module docstring.

    Float32 inputs multiply in exact float32 (not TF32) so that they match the portable backend.
    Off CUDA the kernel runs in Triton's interpreter, whose dot multiplies bfloat16 tiles as
    their raw 16-bit integers, so there every dot runs in float32 too.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = keys.shape[1]
    head_dim_padded = max(MIN_TILE, triton.next_power_of_2(head_dim))
    num_q_blocks = triton.cdiv(max_query_len, config.tokens_per_block)
    if num_kv_splits > 1 and (max_query_len != 1 or first_seq != 0):
        raise ValueError("split-KV runs decodes only, from the first sequence")
    partial_out = partial_lse = out  # placeholders: the kernel reads them only when splitting
    if num_kv_splits > 1:
        partial_lse = torch.empty(
            (num_seqs, num_heads, num_kv_splits), dtype=torch.float32, device=q.device
        )
        partial_out = torch.empty(
            (num_seqs, num_heads, num_kv_splits, head_dim_padded),
            dtype=torch.float32,
            device=q.device,
        )
    _paged_attention_kernel[(num_seqs, num_q_blocks * num_kv_splits, num_kv_heads)](
        out,
        q,
        keys,
        values,
        cu_seqlens_q,
        context_lens,
        page_table,
        partial_out,
        partial_lse,
        first_seq,
        scale,
        1.0 if softcap is None else softcap,
        0 if window is None else window,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        keys.stride(0),
        keys.stride(1),
        page_table.stride(0),
        num_heads,
        HEAD_GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=head_dim_padded,
        PAGE_SIZE=page_size,
        BLOCK_ROWS=config.block_rows,
        TOKENS_PER_BLOCK=config.tokens_per_block,
        BLOCK_KV=config.block_kv_tokens,
        NUM_SPLITS=num_kv_splits,
        DOT_IN_FP32=q.dtype == torch.float32 or not q.is_cuda,
        WINDOWED=window is not None,
        SOFTCAP=softcap is not None,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if num_kv_splits > 1:
        _merge_splits_kernel[(num_seqs, num_heads)](
            out,
            partial_out,
            partial_lse,
            out.stride(0),
            out.stride(1),
            num_heads,
            HEAD_DIM=head_dim,
            HEAD_DIM_PADDED=head_dim_padded,
            NUM_SPLITS=num_kv_splits,
            SPLITS_PADDED=triton.next_power_of_2(num_kv_splits),
        )
