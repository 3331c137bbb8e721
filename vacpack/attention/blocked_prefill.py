"""Causal prefill attention as blocks of plain matmuls, for long bf16 sequences on a CPU.

torch's CPU flash-attention kernel runs at 50-130 GFLOPS on prefill shapes such as
Qwen2.5-0.5B's (14 query heads over 2 KV heads of 64 dims), a tenth of what the same CPU's
bf16 matmuls reach. Cutting the queries into blocks of BLOCK_QUERIES tokens and computing each
block's scores against every key it may see with one batched matmul, a float32 softmax and a
second matmul measured 1.7-2.4x faster from 256 to 2,048 tokens (2 cores, bf16; about even at
128): a block's scores stay in cache, grouped query heads share their KV head's matmul, and
only the blocks on the diagonal need a mask. The work above the diagonal within a block is
wasted, at most half a block per query.

Scores leave the bf16 matmul rounded to bf16, as in transformers' eager attention; probabilities
meet the values in bf16, as in SDPA's own CPU kernel.

The same blocks serve, in any dtype, the prefills SDPA cannot run without a large mask or at
all: a sliding window (each block reads only the keys its queries see) and soft-capped scores.
"""

from __future__ import annotations

import torch

BLOCK_QUERIES = 64
# From here on (keys per sequence) the blocked form beat SDPA's CPU kernel on bf16 where this
# was tuned; on CPUs whose SDPA runs on AMX, or whose bf16 matmuls are slow, SDPA wins at every
# length, so where a model is loaded the choice is measured (attention/selection.py).
MIN_KEYS = 256


def use_blocked_prefill(q: torch.Tensor, num_keys: int, blocked: bool | None = None) -> bool:
    """Whether a causal prefill over `num_keys` keys runs blocked: `blocked` is the measured
    choice for long prefills (None where nothing was measured: long bf16 ones on a CPU)."""
    if num_keys < MIN_KEYS:
        return False
    if blocked is None:
        return q.device.type == "cpu" and q.dtype == torch.bfloat16
    return blocked


def blocked_causal_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [num_queries, heads, dim]; keys and values [num_keys, kv_heads, dim] with num_keys >=
    num_queries. The queries are the sequence's last num_queries tokens: query i sits at
    position num_keys - num_queries + i and sees the keys up to and including that position,
    and with a sliding window only the last `window` of those. `softcap` squashes the scaled
    scores to cap * tanh(score / cap) before the softmax. Returns q's shape.

    A block's scores span only the keys some query of it sees, so with a window the work per
    query is bounded by the window, not the context."""
    num_queries, num_heads, head_dim = q.shape
    num_keys, num_kv_heads = keys.shape[0], keys.shape[1]
    group_size = num_heads // num_kv_heads
    first_position = num_keys - num_queries
    scale = head_dim**-0.5 if scale is None else scale
    keys_by_head = keys.transpose(0, 1).contiguous()  # [kv_heads, num_keys, dim]
    values_by_head = values.transpose(0, 1).contiguous()
    future = torch.ones(BLOCK_QUERIES, BLOCK_QUERIES, dtype=torch.bool).triu_(1)
    out = torch.empty_like(q)
    for start in range(0, num_queries, BLOCK_QUERIES):
        end = min(start + BLOCK_QUERIES, num_queries)
        block_len = end - start
        num_visible = first_position + end  # the keys the block's last query sees
        first_visible = 0 if window is None else max(0, first_position + start - window + 1)
        # [block, heads, dim] -> [kv_heads, block * group, dim]: a KV head's query rows together.
        queries = (
            q[start:end]
            .view(block_len, num_kv_heads, group_size, head_dim)
            .transpose(0, 1)
            .reshape(num_kv_heads, block_len * group_size, head_dim)
        )
        block_keys = keys_by_head[:, first_visible:num_visible]
        num_block_keys = num_visible - first_visible
        scores = torch.baddbmm(
            queries.new_empty(num_kv_heads, block_len * group_size, num_block_keys),
            queries,
            block_keys.transpose(1, 2),
            beta=0.0,
            alpha=scale,
        ).float()
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        by_query = scores.view(num_kv_heads, block_len, group_size, num_block_keys)
        if window is None:
            # The block's own positions: query j may not see key j' > j.
            diagonal = by_query[..., first_position + start - first_visible :]
            diagonal.masked_fill_(future[:block_len, :block_len][None, :, None, :], float("-inf"))
        else:
            query_positions = torch.arange(first_position + start, first_position + end)
            key_positions = torch.arange(first_visible, num_visible)
            offsets = query_positions.unsqueeze(1) - key_positions  # >= 0: the key is not later
            hidden = (offsets < 0) | (offsets >= window)
            by_query.masked_fill_(hidden[None, :, None, :].to(scores.device), float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        block_out = torch.bmm(probs, values_by_head[:, first_visible:num_visible])
        out[start:end] = (
            block_out.view(num_kv_heads, block_len, group_size, head_dim)
            .transpose(0, 1)
            .reshape(block_len, num_heads, head_dim)
        )
    return out
