"""Log-probabilities of given target tokens from hidden states, one number per scored row.

Scoring needs a single entry of each row's distribution over the vocabulary. The LM head runs
on a few hundred rows at a time (a matmul that size runs near the device's peak) and returns
logits in the model's dtype, as the reference computes them. On a CPU the C kernel of
cpu_kernels/token_logprobs.py then reads each row once for its log-sum-exp, the target's entry
and the argmax: on a 2-core Zen 3, 13-14 ms per 256 rows of a 151,936-token vocabulary against
62-91 ms for the log-softmax, gather and argmax below (bench/scoring_kernels.py), and closer to
float64 (1e-6 nats against 3e-5). Without it (no C compiler), the log-softmax runs in float32
on slices of a few rows: a [32, 151,936] float32 slice (19 MB) stays in cache, whereas one
pass over [256, 151,936] (155 MB) streams the logits through memory several times. On a GPU
one pass covers the LM head's rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vacpack.cpu_kernels.token_logprobs import token_logprobs, token_logprobs_supported

# Rows per LM-head pass: the [rows, vocab] logits stay bounded (~155 MB in float32 for a 152k
# vocabulary, half that in bf16) however large the bin.
LM_HEAD_ROWS = 256
# Rows per log-softmax on a CPU without the kernel: a slice that fits the cache. Not much
# smaller, because each slice is a few separate kernel calls.
CPU_SOFTMAX_ROWS = 32


@dataclass(frozen=True)
class TokenScores:
    logprobs: torch.Tensor  # [num_rows] float32, on the host
    is_greedy: torch.Tensor | None  # [num_rows] bool on the host: target == argmax; None if unasked


def score_tokens(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    rows: torch.Tensor,
    targets: torch.Tensor,
    need_greedy: bool,
) -> TokenScores:
    """Log-probability of targets[i] after hidden row rows[i], for every i.

    `compute_logits` maps [n, hidden] rows to [n, vocab] logits, float32 or the model's dtype.
    The argmax (for `is_greedy`) is taken only when asked for: rolling log-likelihoods never
    need it.
    """
    softmax_rows = LM_HEAD_ROWS if hidden.device.type == "cuda" else CPU_SOFTMAX_ROWS
    logprob_parts: list[torch.Tensor] = []
    greedy_parts: list[torch.Tensor] = []
    for start in range(0, rows.numel(), LM_HEAD_ROWS):
        logits = compute_logits(hidden.index_select(0, rows[start : start + LM_HEAD_ROWS]))
        pass_targets = targets[start : start + LM_HEAD_ROWS]
        if token_logprobs_supported(logits):
            row_scores = token_logprobs(logits, pass_targets, with_argmax=need_greedy)
            logprob_parts.append(row_scores.logprobs)
            if row_scores.argmax is not None:
                greedy_parts.append(row_scores.argmax == pass_targets.cpu())
            continue
        for slice_start in range(0, logits.shape[0], softmax_rows):
            # In float32 however the logits came: a no-op for float32 ones, and bf16 logits
            # are converted a cache-sized slice at a time.
            slice_logits = logits[slice_start : slice_start + softmax_rows].float()
            slice_targets = pass_targets[slice_start : slice_start + softmax_rows]
            logprobs = torch.log_softmax(slice_logits, dim=-1)
            logprob_parts.append(logprobs.gather(1, slice_targets.unsqueeze(1)).squeeze(1))
            if need_greedy:
                greedy_parts.append(slice_logits.argmax(dim=-1) == slice_targets)
    return TokenScores(
        torch.cat(logprob_parts).cpu(),
        torch.cat(greedy_parts).cpu() if need_greedy else None,
    )
