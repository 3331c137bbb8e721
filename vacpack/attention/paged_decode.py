"""Decode attention over paged keys and values, in plain batched matmuls.

A decode has one query token, so each KV head meets only its few grouped query heads (7 for
Qwen2.5-0.5B). torch's CPU SDPA kernel is built for long query blocks and measured several times
slower at that shape than two bf16 matmuls around a softmax (bench/decode_attention.py), so
decodes run as those: scores by `baddbmm` (the scale applied before the bf16 rounding), softmax
statistics in float32, probabilities times values by `bmm`.

Decodes are gathered in chunks, longest context first, each padded to its longest member and
capped at a budget of padded key tokens: a chunk's gathered keys and values stay in the CPU's
caches between the gather and the matmuls that read them, and sorting keeps the padding small.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vacpack.kvcache.paged_cache import KVLayer

# Padded key tokens per chunk. A 2-KV-head, 64-dim bf16 token is 256 bytes of keys and as much
# of values, so 16,384 tokens gather 8 MiB, within the L3 of the 2-core CPU this was tuned on;
# smaller chunks cost more kernel launches than the cache misses they save.
DECODE_CHUNK_KEY_TOKENS = 8192


@dataclass(frozen=True)
class KeyPadding:
    """Which of a padded batch's keys are padding. Keys before the shortest member's length are
    real for every member, so the mask covers only the keys from there on."""

    first_padded_key: int  # the shortest member's number of keys
    mask: torch.Tensor  # [seqs, 1, num_keys - first_padded_key] True at padding


@dataclass(frozen=True)
class DecodeChunk:
    """Decodes attended together: their keys gathered into one padded batch."""

    rows: torch.Tensor  # [seqs] stream rows of the chunk's query tokens
    pages: torch.Tensor  # [seqs * pages per seq] page ids, row-major, padded with page 0
    num_keys: int  # the longest member's keys, in tokens; the others are padded to it
    padding: KeyPadding | None  # None when all members have num_keys keys


def plan_chunks(
    num_keys: Sequence[int], budget_tokens: int = DECODE_CHUNK_KEY_TOKENS
) -> list[list[int]]:
    """Indices longest first, cut into chunks whose padded keys (members times the longest)
    fit in budget_tokens; a chunk holds at least one member."""
    order = sorted(range(len(num_keys)), key=lambda i: -num_keys[i])
    chunks: list[list[int]] = []
    for index in order:
        chunk = chunks[-1] if chunks else None
        if chunk is not None and (len(chunk) + 1) * num_keys[chunk[0]] <= budget_tokens:
            chunk.append(index)
        else:
            chunks.append([index])
    return chunks


def build_chunk(
    rows: Sequence[int],
    page_runs: Sequence[Sequence[int]],
    num_keys: Sequence[int],
    page_size: int,
    device: torch.device,
) -> DecodeChunk:
    """A chunk of decodes: row i attends to the first num_keys[i] tokens of page_runs[i]."""
    longest = max(num_keys)
    pages_per_seq = -(-longest // page_size)
    padded_runs = []
    for run, count in zip(page_runs, num_keys, strict=True):
        used = list(run[: -(-count // page_size)])
        padded_runs += used + [0] * (pages_per_seq - len(used))
    padding = None
    shortest = min(num_keys)
    if shortest != longest:
        positions = torch.arange(shortest, longest)
        mask = positions >= torch.tensor(num_keys).unsqueeze(1)
        padding = KeyPadding(shortest, mask.unsqueeze(1).to(device))
    return DecodeChunk(
        rows=torch.tensor(rows, dtype=torch.int64).to(device),
        pages=torch.tensor(padded_runs, dtype=torch.int64).to(device),
        num_keys=longest,
        padding=padding,
    )


def gather_pages(
    cache: torch.Tensor, pages: torch.Tensor, page_size: int, num_seqs: int, num_keys: int
) -> torch.Tensor:
    """[seqs, kv_heads, num_keys, head_dim], contiguous, from whole pages of a layer's cache.

    Each head's keys end up contiguous, the layout the score matmul reads fastest; gathering
    whole pages and transposing once measured faster than gathering one head at a time.
    """
    paged = cache.view(-1, page_size, *cache.shape[1:])
    gathered = paged.index_select(0, pages).view(num_seqs, -1, *cache.shape[1:])
    return gathered[:, :num_keys].transpose(1, 2).contiguous()


def attend(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    padding: KeyPadding | None = None,
    with_lse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Softmax attention, batch by batch: queries [batch, rows, dim] against keys and values
    [batch, num_keys, dim]. Returns [batch, rows, dim] and, when asked, each row's log-sum-exp
    of its scaled scores in float32, [batch, rows].

    padding, when given, marks keys no row may see; its mask broadcasts against the scores
    viewed as [mask.shape[0], -1, num_keys]. Every row must keep at least one key.
    """
    batch, num_rows, head_dim = queries.shape
    num_keys = keys.shape[1]
    scores = torch.baddbmm(
        queries.new_empty(batch, num_rows, num_keys),
        queries,
        keys.transpose(1, 2),
        beta=0.0,
        alpha=head_dim**-0.5,
    )
    if padding is not None:
        by_seq = scores.view(padding.mask.shape[0], -1, num_keys)
        by_seq[..., padding.first_padded_key :].masked_fill_(padding.mask, float("-inf"))
    # In bf16 the softmax still reduces in float32 and rounds once, as SDPA does before its
    # probabilities-times-values matmul.
    probs = torch.softmax(scores, dim=-1)
    lse = None
    if with_lse:
        # The largest probability is exp(max score - lse): two max passes instead of torch's
        # unfused logsumexp, exact but for the one rounding of that probability to q's dtype.
        lse = scores.float().amax(dim=-1) - torch.log(_max_of_nonnegative(probs))
    return torch.bmm(probs, values), lse


def _max_of_nonnegative(x: torch.Tensor) -> torch.Tensor:
    """The max over the last dim of values >= 0, in float32. torch's max over a 16-bit float runs
    unvectorised; non-negative floats order as their bits do, and over those bits read as int16
    it measured 4x faster than converting to float32 first."""
    if x.element_size() != 2:
        return x.amax(dim=-1).float()
    return x.view(torch.int16).amax(dim=-1).view(x.dtype).float()


def chunk_attention(
    q: torch.Tensor, kv_layer: KVLayer, chunk: DecodeChunk, with_lse: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q: [seqs, heads, head_dim], the chunk's query rows. Returns the attention output shaped
    like q and, when asked, the float32 log-sum-exp of each head's scores, [seqs, heads]."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = kv_layer.keys.shape[1]
    page_size = kv_layer.page_size
    keys = gather_pages(kv_layer.keys, chunk.pages, page_size, num_seqs, chunk.num_keys)
    values = gather_pages(kv_layer.values, chunk.pages, page_size, num_seqs, chunk.num_keys)
    # Each KV head's grouped query heads are the rows of one small matmul: [seqs * kv_heads, ...].
    out, lse = attend(
        q.reshape(num_seqs * num_kv_heads, num_heads // num_kv_heads, head_dim),
        keys.view(num_seqs * num_kv_heads, chunk.num_keys, head_dim),
        values.view(num_seqs * num_kv_heads, chunk.num_keys, head_dim),
        chunk.padding,
        with_lse,
    )
    return out.view(num_seqs, num_heads, head_dim), None if lse is None else lse.view(
        num_seqs, num_heads
    )
