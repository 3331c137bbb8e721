"""One position's logprobs as outputs carry them: the chosen token and the top-k candidates."""

from __future__ import annotations

from collections.abc import Callable

from vacpack.outputs import Logprob, PositionLogprobs


def position_logprobs(
    token_text: Callable[[int], str],
    token_id: int,
    logprob: float,
    rank: int,
    topk_ids: list[int],
    topk_logprobs: list[float],
) -> PositionLogprobs:
    """The chosen token first, then the top-k (ranked from 1) where they differ from it."""
    candidates = {token_id: Logprob(logprob, rank, token_text(token_id))}
    for rank_index, (candidate_id, candidate_logprob) in enumerate(
        zip(topk_ids, topk_logprobs, strict=True)
    ):
        candidates.setdefault(
            candidate_id, Logprob(candidate_logprob, rank_index + 1, token_text(candidate_id))
        )
    return candidates
