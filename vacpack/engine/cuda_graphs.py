"""Decode steps replayed from CUDA graphs: one launch per step instead of one per kernel.

A decode step of a small model is dominated by kernel-launch overhead, not by arithmetic. Each
batch-size bucket's forward (embedding through final norm; the LM head and sampler stay outside)
is captured once, largest bucket first, all graphs sharing one memory pool: only one replays at
a time, so a smaller graph's activations can live in the larger ones' memory.

A graph replays with fixed shapes and addresses, so its inputs live in static buffers: the
token ids, the positions and the attention backend's `DecodeGraphBuffers`. A batch is padded up
to its bucket; the dummy rows write their keys and values to the KV cache's scratch page, and
their count is reported as padding. Steps that are not decode-only, or larger than the largest
bucket, or whose contexts outgrow the buffers, return None: the caller runs them eagerly.

With capture=False nothing is captured and the same static-buffer path runs eagerly: the
padding, scratch page and static metadata are then exercised on any device.
"""

from __future__ import annotations

import bisect
import logging

import torch

from vacpack.attention.backend import AttentionBackend, BatchLayout, DecodeGraphBuffers
from vacpack.kvcache.paged_cache import PagedKVCache
from vacpack.models.base import PackedModel
from vacpack.models.forward_context import ForwardContext

logger = logging.getLogger(__name__)

# Buckets: every power of two up to SMALL_BUCKET_LIMIT, then every multiple of BUCKET_STEP, so
# a batch carries at most BUCKET_STEP - 1 dummy rows once it is past the small sizes.
SMALL_BUCKET_LIMIT = 8
BUCKET_STEP = 8


def decode_buckets(max_num_seqs: int) -> list[int]:
    """The batch sizes to capture, ascending; the last is max_num_seqs."""
    sizes = [1 << i for i in range(SMALL_BUCKET_LIMIT.bit_length()) if 1 << i < max_num_seqs]
    sizes += range(SMALL_BUCKET_LIMIT + BUCKET_STEP, max_num_seqs, BUCKET_STEP)
    return [*sizes, max_num_seqs]


class DecodeGraphRunner:
    def __init__(
        self,
        model: PackedModel,
        kv_cache: PagedKVCache,
        backend: AttentionBackend,
        max_num_seqs: int,
        max_pages_per_seq: int,
        device: torch.device,
        capture: bool,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.max_pages_per_seq = max_pages_per_seq
        self.buckets = decode_buckets(max_num_seqs)
        self.buffers: DecodeGraphBuffers | None = backend.make_decode_graph_buffers(
            max_num_seqs, max_pages_per_seq, kv_cache.page_size, device
        )
        self.token_ids = torch.zeros(max_num_seqs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_num_seqs, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.graph_outputs: dict[int, torch.Tensor] = {}  # [bucket, hidden], written by replay
        if capture and self.buffers is not None:
            self._capture_all()

    @property
    def enabled(self) -> bool:
        return self.buffers is not None

    def bucket_for(self, num_seqs: int) -> int | None:
        """The smallest bucket that holds num_seqs rows; None past the largest."""
        index = bisect.bisect_left(self.buckets, num_seqs)
        return self.buckets[index] if index < len(self.buckets) else None

    def can_run(self, layout: BatchLayout) -> bool:
        """True when the step is decode-only and fits a bucket and the static buffers."""
        num_seqs = len(layout.query_lens)
        return (
            num_seqs > 0
            and self.buffers is not None
            and self.bucket_for(num_seqs) is not None
            and layout.num_tokens == num_seqs
            and max(layout.context_lens) <= self.max_pages_per_seq * self.kv_cache.page_size
        )

    @torch.inference_mode()
    def run(
        self, token_ids: torch.Tensor, positions: torch.Tensor, layout: BatchLayout
    ) -> tuple[torch.Tensor, int] | None:
        """Hidden states [num_seqs, hidden] of a decode-only step and the number of dummy rows
        it was padded with; None when this step must run eagerly."""
        if not self.can_run(layout):
            return None
        num_seqs = len(layout.query_lens)
        bucket = self.bucket_for(num_seqs)
        assert bucket is not None and self.buffers is not None  # can_run checked both
        # Dummy rows keep whatever token ids and positions they held: any valid value will do,
        # since their results are dropped and their keys land on the scratch page.
        self.token_ids[:num_seqs].copy_(token_ids, non_blocking=True)
        self.positions[:num_seqs].copy_(positions, non_blocking=True)
        self.buffers.fill(layout, bucket, self.kv_cache.scratch_page)
        if bucket in self.graphs:
            self.graphs[bucket].replay()
            # A copy: the graph's output lives in the shared pool, which another bucket's
            # replay may overwrite before the caller is done with it.
            hidden = self.graph_outputs[bucket][:num_seqs].clone()
        else:
            hidden = self._forward(bucket)[:num_seqs]
        return hidden, bucket - num_seqs

    def _forward(self, bucket: int) -> torch.Tensor:
        assert self.buffers is not None
        ctx = ForwardContext(self.backend, self.buffers.metadata(bucket), self.kv_cache)
        return self.model(self.token_ids[:bucket], self.positions[:bucket], ctx)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        assert self.buffers is not None
        pool = torch.cuda.graph_pool_handle()
        all_padding = BatchLayout([], [], [], self.kv_cache.page_size)
        warmup_stream = torch.cuda.Stream()
        # Largest first: the pool grows to the largest bucket's needs once, and the smaller
        # graphs fit into memory it already holds.
        for bucket in reversed(self.buckets):
            # Every row a dummy: the warm-up and capture runs write only to the scratch page.
            self.buffers.fill(all_padding, bucket, self.kv_cache.scratch_page)
            # The warm-up runs outside capture: it compiles the Triton kernels and lets libraries
            # set up their workspaces, neither of which may happen inside a graph.
            warmup_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(warmup_stream):
                self._forward(bucket)
            torch.cuda.current_stream().wait_stream(warmup_stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.graph_outputs[bucket] = self._forward(bucket)
            self.graphs[bucket] = graph
        torch.cuda.synchronize()


def capture_decode_graphs(
    model: PackedModel,
    kv_cache: PagedKVCache,
    backend: AttentionBackend,
    max_num_seqs: int,
    max_model_len: int,
    device: torch.device,
) -> tuple[DecodeGraphRunner | None, int]:
    """Decode graphs captured now, after the KV cache exists (the graphs hold its addresses),
    and the device memory they took; None when the backend's metadata cannot be captured."""
    free_before_bytes, _ = torch.cuda.mem_get_info(device)
    max_pages_per_seq = -(-max_model_len // kv_cache.page_size)
    runner = DecodeGraphRunner(
        model, kv_cache, backend, max_num_seqs, max_pages_per_seq, device, capture=True
    )
    if not runner.enabled:
        logger.info("attention backend %s cannot replay graphs: eager decode", backend.name)
        return None, 0
    # The graphs' pool holds one decode batch's activations, a small share of the profile
    # forward's peak that sized the KV cache; measured here so the report shows it.
    free_after_bytes, _ = torch.cuda.mem_get_info(device)
    graph_memory_bytes = free_before_bytes - free_after_bytes
    logger.info(
        "captured CUDA graphs for decode batch sizes %s (%.0f MiB measured)",
        runner.buckets,
        graph_memory_bytes / 2**20,
    )
    return runner, graph_memory_bytes
