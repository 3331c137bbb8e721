"""The generator of a seeded request: its own, for the request's whole life, so that its
samples depend on its seed alone, whatever else shares its batches."""

from __future__ import annotations

import torch


def make_request_generator(seed: int, device: torch.device) -> torch.Generator:
    """A generator for one seeded request; keep it for the request's whole life."""
    generator = torch.Generator(device=device)
    generator.manual_seed(_cpu_seed(seed) if generator.device.type == "cpu" else seed)
    return generator


_UINT32_SPAN = 1 << 32
_UINT64_MASK = (1 << 64) - 1


def _cpu_seed(seed: int) -> int:
    """A seed for torch's CPU generator, which keeps only a seed's low 32 bits (mt19937):
    -1 and 2**32 - 1, or 0 and 2**32, would draw the same numbers. Seeds in [0, 2**32) are
    kept (each draws what it always drew); any other is hashed to 32 bits (splitmix64's
    finalizer), so seeds that differ only in their high bits draw unrelated numbers. CUDA's
    generator (Philox) keeps all 64 bits."""
    if 0 <= seed < _UINT32_SPAN:
        return seed
    mixed = (seed + 0x9E3779B97F4A7C15) & _UINT64_MASK
    mixed = ((mixed ^ (mixed >> 30)) * 0xBF58476D1CE4E5B9) & _UINT64_MASK
    mixed = ((mixed ^ (mixed >> 27)) * 0x94D049BB133111EB) & _UINT64_MASK
    return (mixed ^ (mixed >> 31)) % _UINT32_SPAN
