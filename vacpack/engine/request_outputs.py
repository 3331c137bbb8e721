"""A request's RequestOutput, assembled from its sequences per its output kind."""

from __future__ import annotations

import time
from collections.abc import Iterable

from vacpack.engine.request import Request, Sequence
from vacpack.outputs import CompletionOutput, RequestOutput, RequestOutputKind


def make_output(request: Request) -> RequestOutput | None:
    """The output for a request that progressed this step, per its output kind."""
    first = request.sequences[0]
    finished = request.is_finished
    kind = first.params.output_kind
    if kind is RequestOutputKind.FINAL_ONLY and not finished:
        return None
    if kind is RequestOutputKind.DELTA:
        completions = [
            c
            for index, sequence in enumerate(request.sequences)
            if (c := _delta_completion(index, sequence)) is not None
        ]
        first_output = not any(s.num_reported_tokens for s in request.sequences)
        prompt_logprobs = _copy(first.prompt_logprobs) if first_output else None
        for sequence in request.sequences:
            sequence.num_reported_tokens = sequence.num_output_tokens
    else:
        completions = [
            _cumulative_completion(index, sequence)
            for index, sequence in enumerate(request.sequences)
        ]
        prompt_logprobs = _copy(first.prompt_logprobs)
    metrics, sequences = request.metrics, request.sequences
    metrics.first_scheduled_time = _earliest(s.metrics.first_scheduled_time for s in sequences)
    metrics.first_token_time = _earliest(s.metrics.first_token_time for s in sequences)
    metrics.num_preemptions = sum(s.metrics.num_preemptions for s in request.sequences)
    if finished:
        metrics.finished_time = time.perf_counter()
    return RequestOutput(
        request_id=request.request_id,
        prompt=request.prompt,
        prompt_token_ids=first.prompt_token_ids,
        prompt_logprobs=prompt_logprobs,
        outputs=completions,
        finished=finished,
        metrics=metrics,
        num_cached_tokens=first.num_cached_prompt_tokens,
        lora_request=request.lora_request,
    )


def _earliest(times: Iterable[float | None]) -> float | None:
    """The earliest of a request's samples' milestones (None while none reached it)."""
    return min((t for t in times if t is not None), default=None)


def _cumulative_completion(index: int, sequence: Sequence) -> CompletionOutput:
    return CompletionOutput(
        index=index,
        # As in vLLM, without a tail that a stop string could still cut: a later output must
        # not take back text an earlier one showed.
        text=sequence.detokenizer.stable_text,
        token_ids=sequence.output_token_ids,
        cumulative_logprob=sequence.cumulative_logprob if sequence.logprobs is not None else None,
        logprobs=_copy(sequence.logprobs),
        finish_reason=sequence.finish_reason,
        stop_reason=sequence.stop_reason,
    )


def _delta_completion(index: int, sequence: Sequence) -> CompletionOutput | None:
    """What is new since the last output; text only where no stop string can still cut it."""
    start = sequence.num_reported_tokens
    newly_finished = sequence.is_finished and not sequence.finish_reported
    text = sequence.detokenizer.stream_delta()
    if not text and start == sequence.num_output_tokens and not newly_finished:
        return None
    sequence.finish_reported = sequence.is_finished
    return CompletionOutput(
        index=index,
        text=text,
        token_ids=sequence.output_token_ids[start:],
        cumulative_logprob=sequence.cumulative_logprob if sequence.logprobs is not None else None,
        logprobs=None if sequence.logprobs is None else sequence.logprobs[start:],
        finish_reason=sequence.finish_reason,
        stop_reason=sequence.stop_reason,
    )


def _copy(prompt_logprobs: list | None) -> list | None:
    """Outputs get their own list: the engine keeps appending to the sequence's."""
    return None if prompt_logprobs is None else list(prompt_logprobs)
