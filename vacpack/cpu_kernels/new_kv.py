"""A step's new keys and values for a CPU attention kernel to store into its paged cache before
it attends (kv_store.h): their checks and the kernel's arguments for them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vacpack.cpu_kernels.token_rows import heads_side_by_side, rows_of_heads

# The kernels' last arguments when a call stores nothing (its cache's keys are all in place),
# and their status when a new key's slot lies outside the cache.
NO_NEW_KV = (None, None, None, 0, 0, 0, 0)
NEW_SLOT_OUTSIDE_CACHE = -2


@dataclass(frozen=True)
class NewKV:
    """An engine step's new keys and values ([tokens, kv_heads, head_dim], any dtype: stored in
    the cache's) and each token's cache slot ([tokens]), which the kernel stores into the cache
    before it attends (kv_store.h): the same as KVLayer.write, in the same C call."""

    slots: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor


def stored_rows(
    new_kv: NewKV, k: torch.Tensor, v: torch.Tensor, page_size: int | None, keys_packed: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """new_kv's keys and values as rows of heads in the cache's dtype, its slots as int64, and
    the number of slots the cache (k and v, read through pages of page_size slots; None: no
    page tables) holds, checked."""
    if page_size is None:
        raise ValueError("new keys and values are stored into a paged cache: give page tables")
    # The kernel writes the cache k and v in place: they must be the tensors it reads, not a
    # copy with each slot's heads side by side.
    if not (keys_packed or heads_side_by_side(k)) or not heads_side_by_side(v):
        raise ValueError("a cache that new keys are stored into keeps each slot's heads together")
    num_tokens = new_kv.slots.numel()
    expected = (num_tokens, v.shape[1], v.shape[2])
    if new_kv.slots.dim() != 1 or new_kv.keys.shape != expected or new_kv.values.shape != expected:
        raise ValueError(
            f"new keys {tuple(new_kv.keys.shape)} and values {tuple(new_kv.values.shape)} for "
            f"{num_tokens} slots do not match a cache of {v.shape[1]} KV heads of {v.shape[2]}"
        )
    key_slots = k.shape[0] * page_size if keys_packed else k.shape[0]
    slots = new_kv.slots
    if slots.dtype != torch.int64 or not slots.is_contiguous():
        slots = slots.to(torch.int64).contiguous()
    return (
        rows_of_heads(_in_dtype(new_kv.keys, k.dtype)),
        rows_of_heads(_in_dtype(new_kv.values, v.dtype)),
        slots,
        min(key_slots, v.shape[0]),
    )


def _in_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # Every layer of every step comes here: skipping a conversion that has nothing to do saves
    # the microsecond Tensor.to takes to find that out.
    return x if x.dtype == dtype else x.to(dtype)
