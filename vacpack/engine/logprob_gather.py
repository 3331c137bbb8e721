"""Logprobs of given tokens, their ranks and each row's top-k, from a step's logits: for the
sampler's chosen tokens and for prompt logprobs alike."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vacpack.cpu_kernels.token_logprobs import token_logprobs, token_logprobs_supported


@dataclass(frozen=True)
class TokenLogprobs:
    """Logprobs of chosen tokens and of the top candidates, from one log-softmax."""

    token_logprobs: torch.Tensor  # [num_rows] float32
    # 1 = most likely; ties count against the token, so a token tied for first has rank 2.
    token_ranks: torch.Tensor  # [num_rows] int64
    topk_token_ids: torch.Tensor  # [num_rows, num_topk] int64, most likely first
    topk_logprobs: torch.Tensor  # [num_rows, num_topk] float32


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_topk: int
) -> TokenLogprobs:
    """Logprob and rank of ``token_ids`` in each row of ``logprobs``, and each row's top-k.

    ``logprobs`` is [num_rows, vocab_size] log-softmax output; ``token_ids`` is [num_rows].
    The engine can reuse this for prompt logprobs (row i = logits at position i, token = the
    prompt token at i + 1).
    """
    token_logprobs = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    # Counting ">=" (not ">") puts the token behind anything tied with it, as vLLM does.
    token_ranks = (logprobs >= token_logprobs.unsqueeze(1)).sum(dim=1)
    topk_logprobs, topk_token_ids = logprobs.topk(num_topk, dim=1)
    return TokenLogprobs(token_logprobs, token_ranks, topk_token_ids, topk_logprobs)


def logprobs_of(logits: torch.Tensor, token_ids: torch.Tensor, num_topk: int) -> TokenLogprobs:
    """gather_logprobs over the log-softmax of ``logits`` (float32, whatever their dtype).

    On a CPU the C kernel reads each row once for the token's logprob, its rank and the row's
    top-k, where a log-softmax would write a [num_rows, vocab_size] tensor to be read twice more
    (for the rank and the top-k). On a 2-core Zen 3, float32, 151,936-token vocabulary
    (bench/scoring_kernels.py): 14 against 86-107 ms per 256 prompt rows without top-k, 15
    against 115 ms with a top-5, 4.4 against 29-39 ms for a 64-row decode step's top-5. Its
    ranks count logits rather than rounded logprobs: equal, but for tokens within a float32
    rounding step of the token's logprob, which the log-softmax count also takes in; equal
    logprobs in the top-k go in token order.
    """
    if not token_logprobs_supported(logits):
        return gather_logprobs(torch.log_softmax(logits.float(), dim=-1), token_ids, num_topk)
    scores = token_logprobs(logits, token_ids, with_ranks=True, top_k=num_topk)
    assert scores.ranks is not None
    return TokenLogprobs(scores.logprobs, scores.ranks, scores.top_ids, scores.top_logprobs)
