"""EngineConfig: every engine knob in one validated, frozen place (names follow vLLM's)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    model: str
    tokenizer: str | None = None  # defaults to the model's own
    revision: str | None = None
    trust_remote_code: bool = False
    # auto: bfloat16, but float16 for a float16 checkpoint on CUDA, and on a CPU float32 where
    # bfloat16 matmuls are measured much slower (models/cpu_dtype.py); or a name.
    dtype: str = "auto"
    device: str = "auto"  # auto (cuda when present), cpu, cuda, cuda:N
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    max_num_seqs: int = 256  # most requests running at once
    max_num_batched_tokens: int | None = None  # token budget of one step; default per device
    block_size: int = 16  # tokens per KV page
    enable_prefix_caching: bool = True  # reuse the KV pages of repeated prefixes
    seed: int = 0
    kv_cache_memory_bytes: int | None = None  # explicit KV budget; else measured
    gpu_memory_utilization: float = 0.9  # CUDA: share of total device memory we may use
    cpu_kv_cache_fraction: float = 0.4  # CPU: share of available RAM, after loading, for KV
    # auto: the fastest backend present for the device (see vacpack.attention.select_backend).
    attention_backend: str = "auto"
    # The host prepares step N+1 while the device runs step N. None: on where it is measured to
    # help (CUDA), off elsewhere. Outputs are identical either way.
    async_scheduling: bool | None = None
    # CUDA graphs for decode steps (CUDA only); False runs every step eagerly.
    enable_cuda_graphs: bool = True
    num_threads: int | None = None  # CPU: torch intra-op threads; default all cores

    def __post_init__(self) -> None:
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("block_size", self.block_size)
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        if self.max_num_batched_tokens is not None:
            _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.kv_cache_memory_bytes is not None:
            _positive("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        if self.num_threads is not None:
            _positive("num_threads", self.num_threads)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if not 0 < self.cpu_kv_cache_fraction < 1:
            raise ValueError(
                f"cpu_kv_cache_fraction must be in (0, 1), got {self.cpu_kv_cache_fraction}"
            )
        if self.dtype not in ("auto", "bfloat16", "float16", "float32", "half", "float"):
            raise ValueError(
                f"dtype must be auto, bfloat16, float16 or float32, got {self.dtype!r}"
            )


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
