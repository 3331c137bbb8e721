"""What an engine holds on its device: the attention backend, the KV cache and the decode
graphs, set up the same way by rank 0's engine and by every other tensor-parallel rank.

With tensor parallelism rank 0 runs this as an ENGINE_SETUP program (payload: the step token
budget), because sizing the cache (a profile forward on CUDA, then the smallest page count of
all ranks) and capturing decode graphs run collectives on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from vacpack.attention.backend import AttentionBackend
from vacpack.config import EngineConfig
from vacpack.engine.attention_choice import select_engine_attention
from vacpack.engine.cuda_graphs import DecodeGraphRunner, capture_decode_graphs
from vacpack.engine.kv_setup import allocate_kv_cache
from vacpack.engine.step_forward import StepForward
from vacpack.kvcache import PagedKVCache
from vacpack.kvcache.sizing import KVSizing
from vacpack.runtime import LoadedModel


@dataclass(frozen=True)
class EngineDevice:
    attention: AttentionBackend
    kv_sizing: KVSizing
    kv_cache: PagedKVCache
    forward: StepForward
    graph_memory_bytes: int

    @property
    def graph_runner(self) -> DecodeGraphRunner | None:
        return self.forward.graph_runner


def setup_engine_device(
    config: EngineConfig,
    loaded: LoadedModel,
    max_num_batched_tokens: int,
    attention: AttentionBackend | None = None,
) -> EngineDevice:
    """`attention`: the backend rank 0 chose; a worker chooses its own (the same, read from
    the measured choices' cache when rank 0 could write it)."""
    device = loaded.device
    if attention is None:
        attention = select_engine_attention(config, loaded, max_num_batched_tokens).backend
    kv_sizing, kv_cache = allocate_kv_cache(config, loaded, attention, max_num_batched_tokens)
    graph_runner: DecodeGraphRunner | None = None
    graph_memory_bytes = 0
    if device.type == "cuda" and config.enable_cuda_graphs:
        graph_runner, graph_memory_bytes = capture_decode_graphs(
            loaded.model,
            kv_cache,
            attention,
            config.max_num_seqs,
            loaded.max_model_len,
            device,
        )
    forward = StepForward(
        loaded.model, kv_cache, attention, device, config.max_num_seqs, graph_runner, loaded.tp
    )
    return EngineDevice(attention, kv_sizing, kv_cache, forward, graph_memory_bytes)
