"""Turns a scheduled step into tensors, runs the model once, and samples.

The step's sequences are laid out as one packed stream (decodes first, then prefill chunks). The
LM head runs only on the rows that need logits: each sampling request's last row, and the prompt
rows of requests that asked for prompt logprobs.

A step goes through three calls: `prepare` (host: lists and attention metadata), `run` (the
device work, handed to a StepExecutor: input copy, forward, sampling, result copies; nothing in
it waits for the device) and `result` (host values, once the device work is done). Sampled ids
also stay on the device in `future_tokens`, so the next step can be launched before the host
has read them: its input ids name them by placeholder (see PreparedStep.token_ids).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from vacpack.attention.backend import AttentionBackend, BatchLayout
from vacpack.engine.cuda_graphs import DecodeGraphRunner
from vacpack.engine.request import Sequence
from vacpack.engine.sampler import (
    Sampler,
    SamplerOutput,
    SamplingRow,
    TokenLogprobs,
    gather_logprobs,
)
from vacpack.engine.step import PromptLogprobResult, ScheduledChunk, StepResult
from vacpack.kvcache.paged_cache import PagedKVCache
from vacpack.models.base import PackedModel
from vacpack.models.forward_context import ForwardContext, attention_windows
from vacpack.pinned_staging import PinnedStager
from vacpack.structured.token_masks import StepTokenMasks

# Prompt-logprob rows go through the LM head and log-softmax this many at a time, so a long
# prompt chunk never materialises [chunk, vocab] float32 logits at once.
PROMPT_LOGPROB_ROWS_PER_PASS = 512


@dataclass(frozen=True)
class PromptLogprobSpan:
    """Rows [row_start, row_start + num_rows) score prompt tokens first_position + 1 ..."""

    sequence: Sequence
    row_start: int
    first_position: int
    num_rows: int


@dataclass(frozen=True)
class PreparedStep:
    """A step's inputs, built on the host before it is launched."""

    chunks: list[ScheduledChunk]
    # Token ids; a negative id -(slot + 1) is a token sampled by an earlier step that the host
    # has not read yet: the device takes it from slot `slot` of the runner's future buffer.
    token_ids: list[int]
    positions: list[int]
    layout: BatchLayout
    metadata: Any  # the attention backend's, already on the device; None for a graph replay
    use_graph: bool  # a decode-only step that replays a captured CUDA graph
    sample_rows: list[int]  # stream rows whose logits are sampled
    sampled_sequences: list[Sequence]
    sampling_rows: list[SamplingRow]
    future_slots: list[int]  # where each sampled token goes in the future buffer
    prompt_spans: list[PromptLogprobSpan]

    @property
    def has_placeholders(self) -> bool:
        return any(t < 0 for t in self.token_ids[: self.layout.num_decodes])

    @property
    def placeholders(self) -> list[int]:
        """The ids by which later steps refer to the tokens this step samples, row by row."""
        return [-(slot + 1) for slot in self.future_slots]


@dataclass(frozen=True)
class _DeviceOutput:
    """What the device work returns: host tensors (pinned, possibly still being filled on
    CUDA until the step's end event)."""

    sampler_output: SamplerOutput | None
    prompt_logprobs: list[tuple[PromptLogprobSpan, TokenLogprobs]]
    num_padded_slots: int


class ModelRunner:
    def __init__(
        self,
        model: PackedModel,
        kv_cache: PagedKVCache,
        attention: AttentionBackend,
        sampler: Sampler,
        device: torch.device,
        max_num_seqs: int,
        graph_runner: DecodeGraphRunner | None = None,
    ) -> None:
        self.model = model
        self.attention_windows = attention_windows(model)
        self.graph_runner = graph_runner
        self.kv_cache = kv_cache
        self.attention = attention
        self.sampler = sampler
        self.device = device
        self.stager = PinnedStager(device)
        # Sampled token ids stay on the device here so that the next step can read them
        # before the host has. A placeholder lives at most two steps (launched with one step,
        # read back after the next is launched), and a step samples at most max_num_seqs rows,
        # so three steps' worth of slots used round-robin never overwrite a live one.
        self.future_tokens = torch.zeros(3 * max_num_seqs, dtype=torch.int64, device=device)
        self._next_future_slot = 0

    def prepare(self, chunks: list[ScheduledChunk]) -> PreparedStep:
        """Host work: the step's inputs as lists, and the attention metadata."""
        token_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        page_tables: list[list[int]] = []
        sample_rows: list[int] = []
        sampled_sequences: list[Sequence] = []
        prompt_spans: list[PromptLogprobSpan] = []
        for chunk in chunks:
            sequence, start, end = chunk.sequence, chunk.start, chunk.end
            row_start = len(token_ids)
            token_ids.extend(sequence.token_ids[start:end])
            positions.extend(range(start, end))
            query_lens.append(chunk.num_new_tokens)
            context_lens.append(end)
            page_tables.append(list(sequence.page_table))
            if sequence.wants_prompt_logprobs:
                assert sequence.prompt_logprobs is not None
                # Row j predicts token j + 1; score only prompt tokens not scored before.
                first = max(start, len(sequence.prompt_logprobs) - 1)
                last = min(end, sequence.num_prompt_tokens - 1)
                if last > first:
                    prompt_spans.append(
                        PromptLogprobSpan(sequence, row_start + first - start, first, last - first)
                    )
            if chunk.samples and sequence.params.max_tokens != 0:
                sample_rows.append(row_start + chunk.num_new_tokens - 1)
                sampled_sequences.append(sequence)

        layout = BatchLayout(
            query_lens,
            context_lens,
            page_tables,
            self.kv_cache.page_size,
            attention_windows=self.attention_windows,
        )
        use_graph = self.graph_runner is not None and self.graph_runner.can_run(layout)
        num_slots = self.future_tokens.shape[0]
        future_slots = [(self._next_future_slot + i) % num_slots for i in range(len(sample_rows))]
        self._next_future_slot = (self._next_future_slot + len(sample_rows)) % num_slots
        return PreparedStep(
            chunks=chunks,
            token_ids=token_ids,
            positions=positions,
            layout=layout,
            metadata=None if use_graph else self.attention.build_metadata(layout, self.device),
            use_graph=use_graph,
            sample_rows=sample_rows,
            sampled_sequences=sampled_sequences,
            sampling_rows=[_sampling_row(sequence) for sequence in sampled_sequences],
            future_slots=future_slots,
            prompt_spans=prompt_spans,
        )

    @torch.inference_mode()
    def run(self, step: PreparedStep, masks: StepTokenMasks | None = None) -> _DeviceOutput:
        """Device work: copy inputs, run the model, sample, start the copies of the results to
        the host. Nothing here waits for the device; with token masks the host has not filled
        yet, sampling waits for them after the forward."""
        token_ids, positions, sample_rows, future_slots = self.stager.stage(
            [step.token_ids, step.positions, step.sample_rows, step.future_slots]
        )
        if step.has_placeholders:
            from_future = self.future_tokens[(-token_ids - 1).clamp_(min=0)]
            token_ids = torch.where(token_ids < 0, from_future, token_ids)
        num_padded_slots = 0
        if step.use_graph:
            assert self.graph_runner is not None
            replayed = self.graph_runner.run(token_ids, positions, step.layout)
            assert replayed is not None, "prepare checked that the graph runner can run it"
            hidden, num_padded_slots = replayed
        else:
            ctx = ForwardContext(self.attention, step.metadata, self.kv_cache)
            hidden = self.model(token_ids, positions, ctx)

        sampler_output = None
        if step.sampled_sequences:
            # In the model's dtype: the sampler widens them to float32 only where it needs to
            # (greedy rows without penalties or logprobs take the argmax as they are).
            logits = self.model.compute_logits(hidden.index_select(0, sample_rows), dtype=None)
            sampler_output = self.sampler(logits, step.sampling_rows, masks)
            self.future_tokens.index_copy_(0, future_slots, sampler_output.sampled_token_ids)
            sampler_output = _to_host(sampler_output)
        prompt_logprobs = [
            (span, _to_host(self._prompt_logprobs(hidden, span))) for span in step.prompt_spans
        ]
        return _DeviceOutput(sampler_output, prompt_logprobs, num_padded_slots)

    @staticmethod
    def result(step: PreparedStep, output: _DeviceOutput) -> StepResult:
        """The step's results as host values; call once the device work is done."""
        sampler_output = output.sampler_output
        return StepResult(
            sampled_sequences=step.sampled_sequences,
            sampled_token_ids=(
                [] if sampler_output is None else sampler_output.sampled_token_ids.tolist()
            ),
            sampler_output=sampler_output,
            prompt_logprobs=[
                PromptLogprobResult(span.sequence, span.first_position, logprobs)
                for span, logprobs in output.prompt_logprobs
            ],
            num_tokens=len(step.token_ids),
            num_decode_tokens=step.layout.num_decodes,
            num_padded_slots=output.num_padded_slots,
        )

    def _prompt_logprobs(self, hidden: torch.Tensor, span: PromptLogprobSpan) -> TokenLogprobs:
        sequence = span.sequence
        num_topk = sequence.params.prompt_logprobs or 0
        next_tokens = sequence.prompt_token_ids[
            span.first_position + 1 : span.first_position + 1 + span.num_rows
        ]
        parts = []
        for offset in range(0, span.num_rows, PROMPT_LOGPROB_ROWS_PER_PASS):
            count = min(PROMPT_LOGPROB_ROWS_PER_PASS, span.num_rows - offset)
            rows = hidden[span.row_start + offset : span.row_start + offset + count]
            logprobs = torch.log_softmax(self.model.compute_logits(rows), dim=-1)
            targets = torch.tensor(next_tokens[offset : offset + count], device=self.device)
            parts.append(gather_logprobs(logprobs, targets, num_topk))
        return TokenLogprobs(
            *(torch.cat([getattr(p, f) for p in parts]) for f in TokenLogprobs.__dataclass_fields__)
        )


def _sampling_row(sequence: Sequence) -> SamplingRow:
    params = sequence.params
    # Counted with the tokens still being sampled: this row samples the token after them.
    # A grammar decides itself where its output may end.
    too_short = sequence.num_scheduled_output_tokens < params.min_tokens and not (
        params.structured_outputs is not None
    )
    suppress = sequence.stop_token_ids if too_short else frozenset()
    return SamplingRow(
        params=params,
        prompt_token_ids=sequence.prompt_token_ids,
        output_token_ids=sequence.output_token_ids,
        generator=sequence.generator,
        stop_token_ids_to_suppress=suppress,
    )


_Output = TypeVar("_Output", SamplerOutput, TokenLogprobs)


def _to_host(output: _Output) -> _Output:
    """Host copies of a result's tensors. On CUDA the copies go to pinned memory without
    waiting; they are complete once the step's end event has passed."""
    on_host: dict[str, Any] = {}
    for field in dataclasses.fields(output):
        value = getattr(output, field.name)
        on_host[field.name] = None if value is None else value.to("cpu", non_blocking=True)
    return dataclasses.replace(output, **on_host)
