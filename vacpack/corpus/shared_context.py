"""Continuation scoring through the generation engine, so shared contexts are computed once.

Evaluation harnesses score several continuations after the same context (four answers after
one few-shot prompt). Packed bins would compute that context once per continuation; here each
(context, continuation) is an engine request that asks for prompt logprobs of its continuation
only, so the prefix cache serves the context's pages to every continuation after the first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from vacpack.corpus.packing import DocumentError
from vacpack.corpus.tasks import LoglikelihoodTask
from vacpack.engine.engine import LLMEngine
from vacpack.outputs import LoglikelihoodOutput, RequestOutput, RequestOutputKind
from vacpack.sampling import SamplingParams

# Requests handed to the engine at once: enough to keep every step full, few enough that a
# corpus of any size streams through in bounded memory.
IN_FLIGHT_PER_SEQUENCE_SLOT = 4

_SCORE_ONLY = SamplingParams(
    max_tokens=0, prompt_logprobs=0, output_kind=RequestOutputKind.FINAL_ONLY
)


def score_continuations(
    engine: LLMEngine, task: LoglikelihoodTask, pairs: Sequence[tuple[str, str]], use_tqdm: bool
) -> list[LoglikelihoodOutput | DocumentError]:
    results: list[Any] = [None] * len(pairs)
    max_in_flight = IN_FLIGHT_PER_SEQUENCE_SLOT * engine.config.max_num_seqs
    first_scored: dict[str, int] = {}
    progress = tqdm(total=len(pairs), desc="loglikelihood", unit="doc", disable=not use_tqdm)
    pending = iter(enumerate(pairs))
    try:
        exhausted = False
        while True:
            while not exhausted and engine.num_unfinished_requests < max_in_flight:
                item = next(pending, None)
                if item is None:
                    exhausted = True
                    break
                index, pair = item
                try:
                    document = task.encode(index, pair)
                except ValueError as error:
                    results[index] = DocumentError(index, str(error))
                    progress.update(1)
                    continue
                request_id = f"score-{index}"
                first_scored[request_id] = document.payload[0]
                engine.add_request(
                    request_id, document.token_ids.tolist(), _SCORE_ONLY,
                    prompt_logprobs_start=document.payload[0],
                )  # fmt: skip
            if not engine.has_unfinished_requests():
                break
            for output in engine.step():
                index = int(output.request_id.removeprefix("score-"))
                start = first_scored.pop(output.request_id)
                results[index] = _result(index, output, start, task.return_token_logprobs)
                progress.update(1)
    finally:
        progress.close()
        for request_id in first_scored:  # after an interruption, leave nothing running
            engine.abort_request(request_id)
    return results


def _result(
    index: int, output: RequestOutput, first_scored: int, with_token_logprobs: bool
) -> LoglikelihoodOutput:
    token_logprobs, is_greedy = [], True
    assert output.prompt_logprobs is not None, "scored requests ask for prompt logprobs"
    for position in range(first_scored, len(output.prompt_token_ids)):
        scored = output.prompt_logprobs[position]
        assert scored is not None, "every position from first_scored on is scored"
        entry = scored[output.prompt_token_ids[position]]
        token_logprobs.append(entry.logprob)
        is_greedy = is_greedy and entry.rank == 1
    return LoglikelihoodOutput(
        index=index,
        logprob=sum(token_logprobs),
        num_tokens=len(token_logprobs),
        is_greedy=is_greedy,
        token_logprobs=token_logprobs if with_token_logprobs else None,
    )
