"""Sequences and steps for the scheduler's own tests, without a model."""

from __future__ import annotations

from vacpack.engine.request import Request, Sequence
from vacpack.engine.scheduler import Scheduler
from vacpack.outputs import RequestMetrics
from vacpack.sampling import SamplingParams


def add_sequence(
    scheduler: Scheduler,
    name: str,
    token_ids: list[int],
    max_tokens: int = 100,
    max_total_tokens: int = 10_000,
    priority: int = 0,
) -> Sequence:
    """Adds a request of one sequence named `name`; returns the sequence."""
    request = Request(name, None, RequestMetrics(0.0), priority=priority)
    sequence = Sequence(
        request=request,
        index=0,
        prompt_token_ids=token_ids,
        params=SamplingParams(max_tokens=max_tokens),
        stop_token_ids=frozenset(),
        max_total_tokens=max_total_tokens,
        generator=None,
        detokenizer=None,  # type: ignore[arg-type]  # never asked to detokenize here
        metrics=RequestMetrics(0.0),
    )
    request.add_sequence(sequence)
    scheduler.add_request(request)
    return sequence


def run_step(scheduler: Scheduler, sampled_token_id: int = 7) -> dict[str, int]:
    """Schedules one step and applies it as the engine would: lengths advance, the filled pages
    are indexed, and a sampling chunk appends a token. Returns tokens computed per request."""
    output = scheduler.schedule()
    scheduler.on_launch(output.chunks, [], [])
    for chunk in output.chunks:
        scheduler.pages.register_computed_pages(chunk.sequence)
        if chunk.samples:
            chunk.sequence.token_ids.append(sampled_token_id)
    return {chunk.sequence.request.request_id: chunk.num_new_tokens for chunk in output.chunks}


def finish(scheduler: Scheduler, sequence: Sequence) -> None:
    scheduler.abort_request(sequence.request.request_id)
