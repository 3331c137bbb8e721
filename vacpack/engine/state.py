"""What the layers above the engine may know of it: a frozen, typed view.

The server's metrics, job reports and benchmarks read these; nothing outside vacpack/engine/
touches the scheduler, the page pool or the step records themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

from vacpack.tuning import MeasuredChoice


@dataclass(frozen=True)
class EngineSetup:
    """How the engine was built: fixed for its lifetime."""

    device: str
    dtype: str
    attention_backend: str
    async_scheduling: bool
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_pages: int
    page_size: int  # tokens per KV page (the engine argument `block_size`)
    kv_cache_keys: str  # the keys' layout: "packed" for the CPU kernels, or "token rows"
    kv_cache_bytes: int
    kv_cache_source: str  # how the KV budget was found
    cuda_graph_batch_sizes: tuple[int, ...]  # empty when decode steps run eagerly
    cuda_graph_memory_bytes: int
    # What the engine chose by measurement (its attention backend and the backend's options),
    # with the timings that chose it; the model's own choices are in LoadedModel.
    measured_choices: tuple[MeasuredChoice, ...] = ()


@dataclass(frozen=True)
class EngineState:
    """The engine at one moment: its queues, its KV pages, its running totals."""

    num_unfinished_requests: int
    num_running_sequences: int
    num_waiting_sequences: int
    kv_pages_used: int
    kv_pages_total: int
    num_prefix_queried_tokens: int  # prompt tokens looked up in the prefix cache
    num_prefix_hit_tokens: int  # of those, found cached
    num_prefix_evictions: int
    num_steps: int
    num_processed_tokens: int  # prompt and output tokens computed by the model
    num_generated_tokens: int
    num_preemptions: int
    num_draft_tokens: int = 0  # speculative decoding: draft tokens verified
    num_accepted_draft_tokens: int = 0  # of those, accepted

    @property
    def draft_acceptance_rate(self) -> float:
        drafted = self.num_draft_tokens
        return self.num_accepted_draft_tokens / drafted if drafted else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        queried = self.num_prefix_queried_tokens
        return self.num_prefix_hit_tokens / queried if queried else 0.0

    def describe_prefix_cache(self) -> str:
        return (
            f"prefix cache hit rate {self.prefix_cache_hit_rate:.1%} ({self.num_prefix_hit_tokens}"
            f" of {self.num_prefix_queried_tokens} prompt tokens), "
            f"{self.num_prefix_evictions} evictions"
        )
