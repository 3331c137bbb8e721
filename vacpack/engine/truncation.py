"""Truncating a sampling distribution: top-k, top-p (nucleus) and min-p, on logits.

Each keeps a row's most likely tokens and sets the others' logits to -inf:
- top-k keeps every token at least as likely as the k-th (ties at the boundary all stay);
- top-p, on the distribution top-k left (renormalised), keeps the shortest most-likely-first
  prefix whose mass reaches p: a token stays while the mass strictly before it is below p, so
  the first always stays;
- min-p keeps the tokens at least min_p times as likely as the most likely one.

Sorting each row's whole vocabulary is the textbook way to find the top-p prefix, and on a GPU
it is cheap; on a CPU it is not: 480-650 ms for 64 rows of a 151,936-token vocabulary on a 2-core
Zen 3, as long as the model's own decode step. There the boundary is looked for among each
row's largest 256 logits first (one topk, 11 ms): they hold it whenever top-k is on or their
mass reaches p (a trained model's nucleus is rarely more than a few hundred tokens). A nucleus
past them (a flat row: random weights, a high temperature) is found by the C kernel of
cpu_kernels/nucleus.py from a histogram of the row's probability mass (18 ms for 64 rows,
exact against float64 where the float32 sort's running sum drifts by a few tokens); without a
C compiler, by 4,096 candidates and then a whole-row sort. The row is then cut at the
boundary's logit, so tokens tied with the last one kept all stay (as in top-k).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vacpack.cpu_kernels.nucleus import nucleus_cut, nucleus_cut_supported
from vacpack.cpu_kernels.token_logprobs import token_logprobs, token_logprobs_supported

# Logits per row searched for the top-p boundary (more when a row's top-k asks for more); the
# second tier, for the rows the first did not settle (50 against 11 ms for 64 rows of 151,936
# on the Zen 3), only where the nucleus kernel does not run.
CANDIDATE_TIERS = (256, 4096)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Keeps the tokens with probability >= min_p x the largest, as a logit threshold:
    p_i >= min_p p_max exactly where x_i >= x_max + ln(min_p), without a softmax over the
    vocabulary. min_p [num_rows] on the logits' device; a row with min_p 0 is untouched."""
    threshold = logits.amax(dim=-1, keepdim=True) + torch.log(min_p).unsqueeze(1)
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    row_top_k: Sequence[int],
    row_top_p: Sequence[float],
) -> torch.Tensor:
    """The logits with the tokens outside each row's top-k and top-p set to -inf.

    top_k and top_p are [num_rows] float32 on the logits' device (top_k = vocab size where it
    is off, top_p = 1 where it is off); row_top_k and row_top_p are the same values on the
    host, which choose the method without reading the device."""
    if logits.device.type != "cpu":
        return _sorted_top_k_top_p(logits, top_k, top_p)
    num_rows, vocab_size = logits.shape
    use_kernel = nucleus_cut_supported(logits)
    tiers = CANDIDATE_TIERS[:1] if use_kernel else CANDIDATE_TIERS
    cut = torch.full((num_rows,), float("-inf"))
    rows = torch.arange(num_rows)
    to_sort = []
    for tier, tier_candidates in enumerate(tiers):
        row_list = rows.tolist()
        # Enough for the k-th value and the one after it on every row with top-k on.
        wanted = [row_top_k[r] + 1 for r in row_list if row_top_k[r] < vocab_size]
        num_candidates = min(vocab_size, max([tier_candidates, *wanted]))
        p_on = [row_top_p[r] < 1.0 for r in row_list]
        k_off_p_on = any(
            p and row_top_k[r] >= vocab_size for p, r in zip(p_on, row_list, strict=True)
        )
        next_candidates = tiers[tier + 1] if tier + 1 < len(tiers) else None
        # The first tier reads every row in place; later ones copy their few rows out.
        tier_logits = logits if len(row_list) == num_rows else logits[rows]
        tier_cut, undetermined, hopeful = _cut_among_candidates(
            tier_logits,
            top_k[rows],
            top_p[rows],
            num_candidates,
            next_candidates,
            any(p_on),
            k_off_p_on,
        )
        cut[rows] = tier_cut
        to_sort.append(rows[undetermined & ~hopeful])
        rows = rows[undetermined & hopeful]
        if not rows.numel():
            break
    sort_rows = torch.cat([*to_sort, rows]).sort().values  # all rows, if all, in order
    if use_kernel and sort_rows.numel():
        # A nucleus past the candidates with top-k off: its boundary from the histogram.
        nucleus = torch.tensor(
            [row_top_p[r] < 1.0 and row_top_k[r] >= vocab_size for r in sort_rows.tolist()],
            dtype=torch.bool,
        )
        nucleus_rows = sort_rows[nucleus]
        if nucleus_rows.numel():
            nucleus_cuts = nucleus_cut(
                logits if nucleus_rows.numel() == num_rows else logits[nucleus_rows],
                top_p[nucleus_rows],
            )
            settled = ~torch.isnan(nucleus_cuts)
            cut[nucleus_rows[settled]] = nucleus_cuts[settled]
            sort_rows = torch.cat([sort_rows[~nucleus], nucleus_rows[~settled]])
    if sort_rows.numel() == num_rows:  # no row settled: no copies in and out
        return _sorted_top_k_top_p(logits, top_k, top_p)
    out = logits.masked_fill(logits < cut.unsqueeze(1), float("-inf"))
    if sort_rows.numel():
        out[sort_rows] = _sorted_top_k_top_p(logits[sort_rows], top_k[sort_rows], top_p[sort_rows])
    return out


def _cut_among_candidates(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    num_candidates: int,
    next_candidates: int | None,
    p_on: bool,
    k_off_p_on: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row, the smallest logit that stays (-inf: all stay), whether the largest
    `num_candidates` logits left it undetermined, and whether `next_candidates` may settle it:
    not where even that many, each as likely as the last candidate, could not bring the mass
    to p (a flat row goes straight to the sort)."""
    vocab_size = logits.shape[1]
    values, _ = logits.topk(num_candidates, dim=-1)  # sorted, largest first
    k_on = top_k < vocab_size
    # The k-th value, else (top-k off) -inf: no cut.
    kth = values.gather(1, (top_k.long().clamp(max=num_candidates) - 1).unsqueeze(1)).squeeze(1)
    cut = torch.where(k_on, kth, float("-inf"))
    # Rows whose top-k set may reach past the candidates: the value after the k-th ties it.
    after_kth = values.gather(1, top_k.long().clamp(max=num_candidates - 1).unsqueeze(1))
    undetermined = k_on & (after_kth.squeeze(1) == kth)
    if not p_on:  # more candidates would hold more ties, a sort all of them
        return cut, undetermined, torch.zeros_like(undetermined)
    kept = values.masked_fill(values < cut.unsqueeze(1), float("-inf"))
    # The distribution top-k left: normalised over the kept candidates where top-k is on (all
    # of them are candidates), over the whole row where it is off.
    norm = torch.logsumexp(kept, dim=-1)
    if k_off_p_on:
        norm = torch.where(k_on, norm, _row_logsumexp(logits))
    probs = torch.exp(kept - norm.unsqueeze(1))
    mass_before = probs.cumsum(dim=-1) - probs
    stays = mass_before < top_p.unsqueeze(1)  # a prefix of each row's candidates
    last_kept = values.gather(1, (stays.sum(dim=1, keepdim=True) - 1).clamp(min=0)).squeeze(1)
    p_rows = top_p < 1.0
    cut = torch.where(p_rows, torch.maximum(cut, last_kept), cut)
    # Where every candidate stays, the prefix may go on past them.
    p_undetermined = p_rows & stays[:, -1]
    if next_candidates is None:
        return cut, undetermined | p_undetermined, torch.zeros_like(undetermined)
    reachable = probs.sum(dim=-1) + (next_candidates - num_candidates) * probs[:, -1]
    hopeful = p_undetermined & ~undetermined & (reachable >= top_p)
    return cut, undetermined | p_undetermined, hopeful


def _row_logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """log(sum(exp(row))) per row: one read of each row through the scoring kernel where it
    runs (4 ms for 64 rows of 151,936 against 28 ms for torch.logsumexp on the Zen 3)."""
    if token_logprobs_supported(logits):
        targets = torch.zeros(logits.shape[0], dtype=torch.int64)
        scores = token_logprobs(logits, targets, with_logsumexp=True)
        assert scores.logsumexp is not None
        return scores.logsumexp
    return torch.logsumexp(logits, dim=-1)


def _sorted_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Top-k and top-p over each row sorted whole (the GPU's way, and the CPU's for a nucleus
    wider than the candidates). Ties at the top-p boundary stay in sort order here."""
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)

    # A row with top_k off has k = vocab_size and keeps everything.
    kth_index = (top_k.long() - 1).unsqueeze(1)
    kth_logit = sorted_logits.gather(1, kth_index)
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_logit, float("-inf"))

    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # Rounding can push the cumulative mass of a long tail past 1.0; rows with top_p = 1
    # are exempted outright so they stay exactly as they were.
    drop = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))

    return torch.empty_like(logits).scatter_(1, sorted_ids, sorted_logits)
