"""Turns a scheduled step into tensors, runs the model once, and samples.

The step's sequences are laid out as one packed stream (decodes first, then prefill chunks). The
LM head runs only on the rows that need logits: each sampling request's last row, and the prompt
rows of requests that asked for prompt logprobs.

A step goes through three calls: `prepare` (host: lists and attention metadata), `run` (the
device work, handed to a StepExecutor: input copy, forward, sampling, result copies; nothing in
it waits for the device) and `result` (host values, once the device work is done). Sampled ids
also stay on the device (StepForward.future_tokens), so the next step can be launched before
the host has read them: its input ids name them by placeholder (see StepInputs.token_ids).

With tensor parallelism this is rank 0's runner: `run` sends the step's StepInputs to the other
ranks (one ENGINE_STEP broadcast), which run StepForward.run_as_worker; only rank 0 samples.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from vacpack.attention.backend import BatchLayout
from vacpack.distributed.control import Program
from vacpack.distributed.driver import Driver
from vacpack.engine import step_inputs
from vacpack.engine.draft_verification import NO_DRAFT, verify_drafts
from vacpack.engine.logprob_gather import TokenLogprobs, logprobs_of
from vacpack.engine.request import Sequence
from vacpack.engine.sampler import Sampler, SamplerOutput, SamplingRow, greedy_token_ids
from vacpack.engine.step import (
    PromptLogprobResult,
    ScheduledChunk,
    StepResult,
    VerifiedDrafts,
)
from vacpack.engine.step_forward import StepForward
from vacpack.engine.step_inputs import StepInputs, prompt_passes
from vacpack.models.base import PackedModel
from vacpack.structured.token_masks import StepTokenMasks


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
    inputs: StepInputs  # what every rank needs to run it
    metadata: Any  # the attention backend's, already on the device; None for a graph replay
    sampled_sequences: list[Sequence]
    sampling_rows: list[SamplingRow]
    prompt_spans: list[PromptLogprobSpan]
    # Speculating sequences, in the order of their rows in inputs.verify_rows (1 + drafts each).
    speculating: list[ScheduledChunk] = dataclasses.field(default_factory=list)
    # Each verify row's sampling row and the draft it checks, where a speculating sequence
    # samples (draft_verification.py); empty when they are all greedy.
    verify_sampling_rows: list[SamplingRow] = dataclasses.field(default_factory=list)
    verify_drafts: list[int] = dataclasses.field(default_factory=list)

    @property
    def placeholders(self) -> list[int]:
        """The ids by which later steps refer to the tokens this step samples, row by row."""
        return [-(slot + 1) for slot in self.inputs.future_slots]


@dataclass(frozen=True)
class _DeviceOutput:
    """What the device work returns: host tensors (pinned, possibly still being filled on
    CUDA until the step's end event)."""

    sampler_output: SamplerOutput | None
    prompt_logprobs: list[tuple[PromptLogprobSpan, TokenLogprobs]]
    num_padded_slots: int
    collective_s: float | None = None  # tensor parallel on gloo: host time in collectives
    verify_token_ids: torch.Tensor | None = None  # the token each verify row yields
    verify_logprobs: TokenLogprobs | None = None  # of those tokens, where a sequence wants them


class ModelRunner:
    def __init__(
        self,
        forward: StepForward,
        sampler: Sampler,
        driver: Driver | None = None,
        shares_sampled_tokens: bool = False,
    ) -> None:
        self.forward = forward
        self.sampler = sampler
        # Rank 0 of a tensor-parallel group: each step runs as an ENGINE_STEP program.
        self.driver = driver
        self.shares_sampled_tokens = shares_sampled_tokens
        self._next_future_slot = 0

    @property
    def model(self) -> PackedModel:
        return self.forward.model

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
        verify_rows: list[int] = []
        speculating: list[ScheduledChunk] = []
        for chunk in chunks:
            sequence, start, end = chunk.sequence, chunk.start, chunk.end
            row_start = len(token_ids)
            # The chunk's tokens: a speculating decode's drafts follow its last token (they are
            # not the sequence's tokens yet).
            drafts = chunk.draft_token_ids
            token_ids.extend(sequence.token_ids[start : end - len(drafts)])
            token_ids.extend(drafts)
            positions.extend(range(start, end))
            query_lens.append(chunk.num_new_tokens)
            context_lens.append(end)
            page_tables.append(list(sequence.page_table))
            if drafts:
                # Each row's greedy token checks the next draft; the last row's follows them all.
                verify_rows.extend(range(row_start, row_start + chunk.num_new_tokens))
                speculating.append(chunk)
                continue
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

        forward = self.forward
        layout = BatchLayout(
            query_lens,
            context_lens,
            page_tables,
            forward.kv_cache.page_size,
            attention_windows=forward.attention_windows,
        )
        num_slots = forward.future_tokens.shape[0]
        future_slots = [(self._next_future_slot + i) % num_slots for i in range(len(sample_rows))]
        self._next_future_slot = (self._next_future_slot + len(sample_rows)) % num_slots
        lora_ids = [chunk.sequence.lora_id for chunk in chunks]
        if not any(lora_ids):
            lora_ids = []
        inputs = StepInputs(
            token_ids=token_ids,
            positions=positions,
            layout=layout,
            # A captured graph runs the base model's linears alone.
            use_graph=not lora_ids
            and forward.graph_runner is not None
            and forward.graph_runner.can_run(layout),
            sample_rows=sample_rows,
            future_slots=future_slots,
            prompt_passes=[
                part
                for span in prompt_spans
                for part in prompt_passes(span.row_start, span.num_rows)
            ],
            shares_sampled_tokens=self.shares_sampled_tokens and bool(sample_rows),
            verify_rows=verify_rows,
            lora_ids=lora_ids,
        )
        verify_sampling_rows: list[SamplingRow] = []
        verify_drafts: list[int] = []
        if any(not chunk.sequence.params.is_greedy for chunk in speculating):
            for chunk in speculating:
                verify_sampling_rows += [_sampling_row(chunk.sequence)] * chunk.num_new_tokens
                verify_drafts += [*chunk.draft_token_ids, NO_DRAFT]
        return PreparedStep(
            chunks=chunks,
            inputs=inputs,
            metadata=forward.build_metadata(inputs),
            sampled_sequences=sampled_sequences,
            sampling_rows=[_sampling_row(sequence) for sequence in sampled_sequences],
            prompt_spans=prompt_spans,
            speculating=speculating,
            verify_sampling_rows=verify_sampling_rows,
            verify_drafts=verify_drafts,
        )

    def run(self, step: PreparedStep, masks: StepTokenMasks | None = None) -> _DeviceOutput:
        """Device work: copy inputs, run the model, sample, start the copies of the results to
        the host. Nothing here waits for the device; with token masks the host has not filled
        yet, sampling waits for them after the forward. With tensor parallelism the step's
        inputs go to the other ranks first (one broadcast) and they run it alongside."""
        if self.driver is None:
            return self._run(step, masks)
        collectives = self.forward.tp.collectives
        assert collectives is not None
        with self.driver.program(Program.ENGINE_STEP, step_inputs.encode(step.inputs)):
            blocked_before_s = collectives.blocked_s
            output = self._run(step, masks)
        collective_s = collectives.blocked_s - blocked_before_s if collectives.blocks_host else None
        return dataclasses.replace(output, collective_s=collective_s)

    @torch.inference_mode()
    def _run(self, step: PreparedStep, masks: StepTokenMasks | None) -> _DeviceOutput:
        forward = self.forward
        output = forward.forward(step.inputs, step.metadata)
        sampler_output = None
        if step.sampled_sequences:
            # In the model's dtype: the sampler widens them to float32 only where it needs to
            # (greedy rows without penalties or logprobs take the argmax as they are).
            logits = self.model.compute_logits(output.sampled_hidden(), dtype=None)
            sampler_output = self.sampler(logits, step.sampling_rows, masks)
            sampled = sampler_output.sampled_token_ids
            if step.inputs.shares_sampled_tokens:
                sampled = forward.share_sampled(sampled.contiguous())
            forward.store_sampled(sampled, output.future_slots)
            sampler_output = _to_host(sampler_output)
        verify_token_ids = None
        verify_logprobs = None
        if step.speculating:
            logits = self.model.compute_logits(output.verify_hidden(), dtype=None)
            if step.verify_sampling_rows:
                verified = verify_drafts(
                    self.sampler, logits, step.verify_sampling_rows, step.verify_drafts
                )
            else:  # all greedy without penalties (speculation.speculates): the raw argmax
                verified = greedy_token_ids(logits)
            verify_token_ids = verified.to("cpu", non_blocking=True)
            if any(c.sequence.logprobs is not None for c in step.speculating):
                num_topk = max((c.sequence.params.logprobs or 0) for c in step.speculating)
                verify_logprobs = _to_host(logprobs_of(logits, verified, num_topk))
        prompt_logprobs = [
            (span, _to_host(self._prompt_logprobs(output.hidden, span)))
            for span in step.prompt_spans
        ]
        return _DeviceOutput(
            sampler_output,
            prompt_logprobs,
            output.num_padded_slots,
            verify_token_ids=verify_token_ids,
            verify_logprobs=verify_logprobs,
        )

    def result(self, step: PreparedStep, output: _DeviceOutput) -> StepResult:
        """The step's results as host values; call once the device work is done."""
        if self.driver is not None:
            # On CUDA a failed rank shows after the launch: its results are not to be trusted.
            self.driver.raise_if_failed()
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
            num_tokens=len(step.inputs.token_ids),
            num_decode_tokens=step.inputs.layout.num_decodes,
            num_padded_slots=output.num_padded_slots,
            collective_s=output.collective_s,
            verified=_verified_drafts(
                step.speculating, output.verify_token_ids, output.verify_logprobs
            ),
        )

    def _prompt_logprobs(self, hidden: torch.Tensor, span: PromptLogprobSpan) -> TokenLogprobs:
        sequence = span.sequence
        num_topk = sequence.params.prompt_logprobs or 0
        parts = []
        for row_start, num_rows in prompt_passes(span.row_start, span.num_rows):
            logits = self.model.compute_logits(hidden[row_start : row_start + num_rows])
            first_target = span.first_position + 1 + row_start - span.row_start
            targets = torch.tensor(
                sequence.prompt_token_ids[first_target : first_target + num_rows],
                device=self.forward.device,
            )
            parts.append(logprobs_of(logits, targets, num_topk))
        return TokenLogprobs(
            *(torch.cat([getattr(p, f) for p in parts]) for f in TokenLogprobs.__dataclass_fields__)
        )


def _verified_drafts(
    speculating: list[ScheduledChunk],
    verify_token_ids: torch.Tensor | None,
    verify_logprobs: TokenLogprobs | None,
) -> list[VerifiedDrafts]:
    """Each speculating chunk's drafts with the tokens its rows yield (and their logprobs,
    where the sequence wants them)."""
    if verify_token_ids is None:
        return []
    token_ids = verify_token_ids.tolist()
    verified = []
    row = 0
    for chunk in speculating:
        rows = slice(row, row + chunk.num_new_tokens)
        logprobs = None
        if verify_logprobs is not None and chunk.sequence.logprobs is not None:
            logprobs = TokenLogprobs(
                *(getattr(verify_logprobs, f)[rows] for f in TokenLogprobs.__dataclass_fields__)
            )
        verified.append(
            VerifiedDrafts(chunk.sequence, chunk.draft_token_ids, token_ids[rows], logprobs)
        )
        row += chunk.num_new_tokens
    return verified


def _sampling_row(sequence: Sequence) -> SamplingRow:
    params = sequence.params
    # Counted with the tokens still being sampled: this row samples the token after them.
    # A grammar decides itself where its output may end.
    too_short = sequence.num_scheduled_output_tokens < params.min_tokens and not (
        params.structured_outputs is not None
    )
    if not params.has_penalties:
        # Without penalties nothing in the row changes from step to step but the suppression:
        # built once per sequence and state, not once per step (host time per sequence).
        cached = sequence.sampling_rows.get(too_short)
        if cached is None:
            cached = sequence.sampling_rows[too_short] = _new_sampling_row(sequence, too_short)
        return cached
    return _new_sampling_row(sequence, too_short)


def _new_sampling_row(sequence: Sequence, too_short: bool) -> SamplingRow:
    params = sequence.params
    return SamplingRow(
        params=params,
        prompt_token_ids=sequence.prompt_token_ids,
        # Read by penalties alone: no copy of every sequence's output at every step otherwise.
        output_token_ids=sequence.output_token_ids if params.has_penalties else (),
        generator=sequence.generator,
        stop_token_ids_to_suppress=sequence.stop_token_ids if too_short else frozenset(),
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
