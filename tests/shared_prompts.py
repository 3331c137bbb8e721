"""Prompts that share a long prefix: what a cascade reads once for all of them."""

from __future__ import annotations

import torch

SHARED_PREFIX_LEN = 100


def shared_prefix_prompts(vocab_size: int, num_prompts: int = 16, seed: int = 5) -> list[list[int]]:
    """`num_prompts` random prompts: the same SHARED_PREFIX_LEN tokens, then 1..19 of their
    own."""
    generator = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, vocab_size, (SHARED_PREFIX_LEN,), generator=generator).tolist()
    return [
        shared + torch.randint(0, vocab_size, (n,), generator=generator).tolist()
        for n in torch.randint(1, 20, (num_prompts,), generator=generator).tolist()
    ]
