"""Phi-3 (and Phi-3.5, Phi-4-mini): Llama with q, k and v stored as one checkpoint tensor and
gate and up as another, partial rotary on some sizes, and longrope scaling for long contexts.

The fused tensors load into the same merged layers Llama uses, each rank taking its slice of
every part, so tensor parallelism shards them like separate q, k, v, gate and up weights.
"""

from __future__ import annotations

from typing import ClassVar

from vacpack.models.llama import LlamaForCausalLM
from vacpack.models.parallel import ALL_SHARDS


class Phi3ForCausalLM(LlamaForCausalLM):
    MERGED_WEIGHTS: ClassVar[dict[str, tuple[str, int]]] = {
        "qkv_proj": ("qkv_proj", ALL_SHARDS),
        "gate_up_proj": ("gate_up_proj", ALL_SHARDS),
    }
