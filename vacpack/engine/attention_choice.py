"""The engine's attention backend, chosen by timing its decode step and its prefill step at the
model's shapes.

The decode batch timed is the one the scheduler forms: as many sequences as a step may run
(max_num_seqs, and no more than the step's token budget), capped at DECODE_TIMED_SEQS so that
timing stays within its budget, with contexts spread up to DECODE_TIMED_CONTEXT tokens. The
prefill step timed is PREFILL_TIMED_SEQS chunks of up to PREFILL_TIMED_CHUNK tokens (within the
step's token budget) over as many cached tokens: chunked prefill of long prompts. Where another
backend wins the prefill step, steps with prefill run on it (vacpack/attention/step_routed.py).
"""

from __future__ import annotations

from vacpack.attention import (
    DecodeBatchShape,
    PagedPrefillShape,
    SelectedBackend,
    select_backend,
)
from vacpack.config import EngineConfig
from vacpack.runtime import LoadedModel
from vacpack.tuning.allowance import spending

# Beyond this many, more sequences only add the same per-sequence work: their time per
# sequence no longer changes which path is faster, while a slow path's one call may take
# longer than the whole budget on a small CPU.
DECODE_TIMED_SEQS = 64
DECODE_TIMED_CONTEXT = 512
PREFILL_TIMED_SEQS = 2
PREFILL_TIMED_CHUNK = 512


def decode_batch_shape(
    config: EngineConfig, max_num_batched_tokens: int, max_model_len: int
) -> DecodeBatchShape:
    num_seqs = min(config.max_num_seqs, max_num_batched_tokens, DECODE_TIMED_SEQS)
    longest_context = max(1, min(max_model_len - 1, DECODE_TIMED_CONTEXT))
    return DecodeBatchShape(num_seqs, longest_context, config.block_size)


def prefill_step_shape(
    config: EngineConfig, max_num_batched_tokens: int, max_model_len: int
) -> PagedPrefillShape:
    num_seqs = max(1, min(config.max_num_seqs, PREFILL_TIMED_SEQS))
    chunk_tokens = max(2, min(PREFILL_TIMED_CHUNK, max_num_batched_tokens // num_seqs))
    chunk_tokens = min(chunk_tokens, max(2, max_model_len // 2))
    cached_tokens = max(0, min(chunk_tokens, max_model_len - chunk_tokens))
    return PagedPrefillShape(num_seqs, chunk_tokens, cached_tokens, config.block_size)


def select_engine_attention(
    config: EngineConfig, loaded: LoadedModel, max_num_batched_tokens: int
) -> SelectedBackend:
    """config.attention_backend ("auto": the fastest at the model's decode step, and at its
    prefill step where that differs), with the options measured for it (the cascade for shared
    prefixes, torch_sdpa's prefill and decode forms), timed within what is left of the load's
    timing allowance."""
    with spending(loaded.timing_allowance):
        return select_backend(
            config.attention_backend,
            loaded.device,
            loaded.attention_shapes,
            decode_batch_shape(config, max_num_batched_tokens, loaded.max_model_len),
            prefill_step=prefill_step_shape(config, max_num_batched_tokens, loaded.max_model_len),
        )
