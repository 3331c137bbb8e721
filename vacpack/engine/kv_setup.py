"""The engine's KV cache: sized from memory measured after the model is loaded, then allocated.

On CUDA the size comes from a profile forward at the largest step shape (its peak activation
memory stays free); on a CPU from the RAM still available; an explicit budget wins over both.

With tensor parallelism every rank sizes its own cache (its share of the KV heads, its own
device's memory; on a CPU the ranks share the RAM, so each takes 1/N of the fraction), and all
use the smallest page count any rank can hold: rank 0 schedules one page table for all.
"""

from __future__ import annotations

import dataclasses

import torch

from vacpack.attention.backend import AttentionBackend, BatchLayout
from vacpack.config import EngineConfig
from vacpack.kvcache import PagedKVCache, kv_bytes_per_token
from vacpack.kvcache.sizing import KVSizing, size_kv_cache
from vacpack.models.base import PackedModel
from vacpack.models.forward_context import ForwardContext, attention_windows
from vacpack.runtime import LoadedModel


def allocate_kv_cache(
    config: EngineConfig,
    loaded: LoadedModel,
    attention: AttentionBackend,
    max_num_batched_tokens: int,
) -> tuple[KVSizing, PagedKVCache]:
    model_config = loaded.config
    num_profile_tokens = min(max_num_batched_tokens, loaded.max_model_len)
    sizing = size_kv_cache(
        device=loaded.device,
        bytes_per_token=kv_bytes_per_token(
            model_config.num_layers,
            loaded.num_kv_heads,
            model_config.head_dim,
            loaded.kv_cache_dtype,
        ),
        page_size=config.block_size,
        max_model_len=loaded.max_model_len,
        pages_per_sequence=pages_one_sequence_holds(
            loaded.max_model_len, config.block_size, model_config.kv_window, max_num_batched_tokens
        ),
        max_num_seqs=config.max_num_seqs,
        explicit_budget_bytes=config.kv_cache_memory_bytes,
        gpu_memory_utilization=config.gpu_memory_utilization,
        cpu_kv_cache_fraction=config.cpu_kv_cache_fraction / loaded.tp.size,
        profile_forward=lambda: profile_forward(
            loaded.model,
            attention,
            num_profile_tokens,
            min(num_profile_tokens, config.max_num_seqs),
            loaded.device,
        ),
    )
    if loaded.tp.collectives is not None:
        agreed = loaded.tp.collectives.min_int(sizing.num_pages, loaded.device)
        sizing = dataclasses.replace(sizing, num_pages=agreed)
    kv_cache = PagedKVCache(
        model_config.num_layers,
        sizing.num_pages,
        config.block_size,
        loaded.num_kv_heads,
        model_config.head_dim,
        loaded.kv_cache_dtype,
        loaded.device,
        packed_keys=attention.packs_keys(loaded.dtype, loaded.kv_cache_dtype, config.block_size),
    )
    return sizing, kv_cache


def pages_one_sequence_holds(
    max_model_len: int, page_size: int, kv_window: int | None, max_num_batched_tokens: int
) -> int:
    """The most KV pages one sequence holds at once: its whole context's, unless every layer
    has a sliding window (`kv_window`, the largest). Then pages behind the window go back as it
    advances (window_pages.py), and it holds the window, the chunk a step computes, and, with
    prefix caching and async scheduling, a chunk in flight whose pages are not indexed yet (only
    indexed pages go back), plus the two pages those spans partly fill."""
    whole_context = -(-max_model_len // page_size)
    if kv_window is None:
        return whole_context
    window_and_steps = -(-(kv_window + 2 * max_num_batched_tokens) // page_size) + 2
    return min(whole_context, window_and_steps)


@torch.inference_mode()
def profile_forward(
    model: PackedModel,
    attention: AttentionBackend,
    num_tokens: int,
    num_logit_rows: int,
    device: torch.device,
) -> None:
    """One forward at the largest step shape, without a KV cache."""
    layout = BatchLayout([num_tokens], [num_tokens], attention_windows=attention_windows(model))
    ctx = ForwardContext(attention, attention.build_metadata(layout, device), None)
    token_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    hidden = model(token_ids, torch.arange(num_tokens, device=device), ctx)
    model.compute_logits(hidden[-num_logit_rows:])
