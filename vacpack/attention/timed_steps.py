"""One layer's attention at a loaded model's own shapes, as calls to time against each other.

Measured selection (selection.py) runs each candidate backend on the same inputs: random
queries, keys and values in the model's dtype (a KV cache in its own) with its heads and head
size, laid out as the phase runs them. A packed bin is whole sequences in one stream without a
KV cache (a corpus bin, or an encoder's batch); a decode batch is one query token per sequence
over a paged KV cache (the engine's decode step), its contexts spread evenly up to the longest,
optionally behind a prefix all of them share (the pages prefix caching leaves for a shared
system prompt); a paged prefill is chunks of several query tokens per sequence over cached pages
(an engine step of chunked prefill).

A call runs every distinct kind of layer once (a model whose layers alternate sliding windows
runs one of each). Each candidate's backend and step metadata are built, and its layers run
once, when the calls are made, before any timing: the engine too builds metadata once per step
for all layers, and a first run's one-time costs (a Triton kernel's compilation, oneDNN
primitives) must not count against it even where the time budget leaves no timed round after
the timer's own warm-up. A candidate that failed there raises the same error at every call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from vacpack.attention.backend import (
    FULL_ATTENTION,
    AttentionBackend,
    AttentionSpec,
    BatchLayout,
    describe_spec,
)
from vacpack.cpu_kernels.packed_keys import pack_keys
from vacpack.kvcache.paged_cache import KVLayer


@dataclass(frozen=True)
class AttentionShapes:
    """How the model's layers attend: its heads, head size, dtypes, and the layers' specs."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    specs: tuple[AttentionSpec, ...] = ()  # one per layer; empty: full attention
    max_model_len: int = 2048  # the longest sequence the model runs
    kv_cache_dtype: torch.dtype | None = None  # None: `dtype`

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.kv_cache_dtype or self.dtype

    @property
    def distinct_specs(self) -> tuple[AttentionSpec, ...]:
        return tuple(dict.fromkeys(self.specs)) or (FULL_ATTENTION,)

    @property
    def windows(self) -> tuple[int | None, ...]:
        windows = {spec.sliding_window for spec in self.distinct_specs}
        return tuple(sorted(windows, key=lambda w: -1 if w is None else w))

    def key(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        if self.cache_dtype != self.dtype:
            dtype += f", {str(self.cache_dtype).removeprefix('torch.')} KV cache"
        kinds = "; ".join(describe_spec(spec) for spec in self.distinct_specs)
        return (
            f"{self.num_heads} heads over {self.num_kv_heads} kv heads of {self.head_dim}, "
            f"{dtype}, {kinds}"
        )


@dataclass(frozen=True)
class PackedBinShape:
    """`num_seqs` whole sequences of `seq_len` tokens in one stream, without a KV cache."""

    num_seqs: int
    seq_len: int
    causal: bool = True

    def key(self) -> str:
        kind = "causal" if self.causal else "bidirectional"
        return f"packed {self.num_seqs} x {self.seq_len} {kind}"


@dataclass(frozen=True)
class DecodeBatchShape:
    """`num_seqs` decodes (one query token each) over pages of `page_size` tokens: own contexts
    evenly spread from a quarter of `longest_context` to all of it, behind
    `shared_prefix_tokens` that all of them share (a whole number of pages)."""

    num_seqs: int
    longest_context: int
    page_size: int
    shared_prefix_tokens: int = 0

    def context_lens(self) -> list[int]:
        shortest = max(1, self.longest_context // 4)
        spread = self.longest_context - shortest
        steps = max(1, self.num_seqs - 1)
        own = [shortest + spread * i // steps for i in range(self.num_seqs)]
        return [self.shared_prefix_tokens + n for n in own]

    def key(self) -> str:
        shared = f", {self.shared_prefix_tokens} shared" if self.shared_prefix_tokens else ""
        return (
            f"decode {self.num_seqs} seqs of <= {self.longest_context} own tokens{shared}, "
            f"pages of {self.page_size}"
        )


@dataclass(frozen=True)
class PagedPrefillShape:
    """An engine step of prefill chunks: `num_seqs` sequences each adding `chunk_tokens` query
    tokens over `cached_tokens` already in the paged cache (chunked prefill; 0: fresh prompts)."""

    num_seqs: int
    chunk_tokens: int
    cached_tokens: int
    page_size: int

    def context_lens(self) -> list[int]:
        return [self.cached_tokens + self.chunk_tokens] * self.num_seqs

    def key(self) -> str:
        return (
            f"prefill {self.num_seqs} x {self.chunk_tokens} new tokens over "
            f"{self.cached_tokens} cached, pages of {self.page_size}"
        )


Workload = PackedBinShape | DecodeBatchShape | PagedPrefillShape
TimedCall = Callable[[], object]


def _random(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # Uniform in the target dtype directly: no float32 copy of a large KV cache to convert.
    return torch.empty(shape, dtype=dtype, device=device).uniform_(-1.0, 1.0)


@dataclass(frozen=True)
class _Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kv_layer: KVLayer | None
    layout: BatchLayout

    def kv_layer_for(self, backend: AttentionBackend) -> KVLayer | None:
        """The cache in the layout the engine would give `backend`: keys packed where it
        packs them (made once, shared by all candidates that do)."""
        kv_layer = self.kv_layer
        if kv_layer is None or not backend.packs_keys(
            self.q.dtype, kv_layer.keys.dtype, kv_layer.page_size
        ):
            return kv_layer
        return self._packed_kv_layer

    @functools.cached_property
    def _packed_kv_layer(self) -> KVLayer:
        kv_layer = self.kv_layer
        assert kv_layer is not None
        keys = pack_keys(kv_layer.keys, kv_layer.page_size)
        return KVLayer(keys, kv_layer.values, kv_layer.page_size, packed_keys=True)


def _inputs(shapes: AttentionShapes, workload: Workload, device: torch.device) -> _Inputs:
    heads, kv_heads, dim = shapes.num_heads, shapes.num_kv_heads, shapes.head_dim
    dtype = shapes.dtype
    if isinstance(workload, PackedBinShape):
        seq_lens = [workload.seq_len] * workload.num_seqs
        num_tokens = sum(seq_lens)
        layout = BatchLayout(
            seq_lens, seq_lens, causal=workload.causal, attention_windows=shapes.windows
        )
        kv_layer = None
    else:
        page_size = workload.page_size
        context_lens = workload.context_lens()
        shared_prefix_tokens = (
            workload.shared_prefix_tokens if isinstance(workload, DecodeBatchShape) else 0
        )
        prefix_pages = shared_prefix_tokens // page_size
        next_page = prefix_pages
        page_tables = []
        for context_len in context_lens:
            num_own = -(-context_len // page_size) - prefix_pages
            own_pages = list(range(next_page, next_page + num_own))
            page_tables.append(list(range(prefix_pages)) + own_pages)
            next_page += num_own
        num_slots = next_page * page_size
        kv_layer = KVLayer(
            _random((num_slots, kv_heads, dim), shapes.cache_dtype, device),
            _random((num_slots, kv_heads, dim), shapes.cache_dtype, device),
            page_size,
        )
        query_lens = (
            [workload.chunk_tokens] * workload.num_seqs
            if isinstance(workload, PagedPrefillShape)
            else [1] * workload.num_seqs
        )
        num_tokens = sum(query_lens)
        layout = BatchLayout(
            query_lens,
            context_lens,
            page_tables,
            page_size,
            attention_windows=shapes.windows,
        )
    return _Inputs(
        _random((num_tokens, heads, dim), dtype, device),
        _random((num_tokens, kv_heads, dim), dtype, device),
        _random((num_tokens, kv_heads, dim), dtype, device),
        kv_layer,
        layout,
    )


def timed_calls(
    backends: Mapping[str, Callable[[], AttentionBackend]],
    shapes: AttentionShapes,
    workload: Workload,
    device: torch.device,
    specs: tuple[AttentionSpec, ...] | None = None,
) -> dict[str, TimedCall]:
    """One call per candidate, each running one layer of every distinct kind (or of `specs`)
    through the backend its factory builds, on inputs shared by all candidates."""
    inputs = _inputs(shapes, workload, device)
    layer_specs = specs or shapes.distinct_specs
    return {name: _LayerCall(factory, inputs, layer_specs) for name, factory in backends.items()}


class _LayerCall:
    def __init__(
        self,
        make_backend: Callable[[], AttentionBackend],
        inputs: _Inputs,
        specs: tuple[AttentionSpec, ...],
    ) -> None:
        self._inputs = inputs
        self._specs = specs
        self._error: Exception | None = None
        try:
            self._backend = make_backend()
            self._metadata = self._backend.build_metadata(inputs.layout, inputs.q.device)
            self._kv_layer = inputs.kv_layer_for(self._backend)
        except Exception as error:  # a candidate that cannot run here is ruled out, not fatal
            self._error = error

    def __call__(self) -> list[torch.Tensor]:
        if self._error is not None:
            raise self._error
        inputs = self._inputs
        with torch.inference_mode():
            outs = [
                self._backend.forward(
                    inputs.q, inputs.k, inputs.v, self._kv_layer, self._metadata, spec
                )
                for spec in self._specs
            ]
        if inputs.q.device.type == "cuda":
            torch.cuda.synchronize(inputs.q.device)  # the kernels' time, not their launch
        return outs
