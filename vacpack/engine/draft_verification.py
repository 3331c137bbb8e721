"""Which token each row of a speculating sequence yields: its draft, where the model accepts it.

A greedy row yields its argmax: the draft where the model would have chosen it. A sampled row
accepts its draft with the draft's probability under the row's distribution p (temperature,
top-k, top-p, min-p applied), and otherwise yields a token drawn from p without the draft
(renormalized). That is rejection sampling against a draft that proposes one token for sure,
and a token comes out with probability p(draft) for the draft and (1 - p(draft)) x p(y) /
(1 - p(draft)) = p(y) for any other y: exactly the distribution of sampling one at a time. A
sequence's last row, with no draft to check, samples p as any decode does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vacpack.engine.sampler import Sampler, SamplingRow, greedy_token_ids

NO_DRAFT = -1  # a row after every draft: it yields a token sampled as a decode's


def verify_drafts(
    sampler: Sampler, logits: torch.Tensor, rows: Sequence[SamplingRow], drafts: Sequence[int]
) -> torch.Tensor:
    """The token each row yields (its draft where accepted): logits [num_rows, vocab] in the
    model's dtype, rows[i] the sampling row of the sequence that row i belongs to, drafts[i]
    the draft row i checks or NO_DRAFT."""
    params = [row.params for row in rows]
    if all(p.is_greedy for p in params):
        return greedy_token_ids(logits)
    logits = logits.float()
    probs = sampler.probabilities(logits, rows, sampler.row_param_matrix(params))
    draft = torch.tensor(drafts, dtype=torch.int64, device=logits.device)
    has_draft = draft != NO_DRAFT
    draft_column = draft.clamp(min=0).unsqueeze(1)
    draft_probability = probs.gather(1, draft_column).squeeze(1)
    accepted = has_draft & (sampler.uniforms(rows).squeeze(1) < draft_probability)
    # Rows that reject their draft draw from the rest of their distribution.
    without_draft = probs.scatter(1, draft_column, 0.0)
    residual = torch.where(has_draft.unsqueeze(1), without_draft, probs)
    sampled = torch.where(accepted, draft, sampler.draw(residual, rows))
    greedy = torch.tensor([p.is_greedy for p in params], device=logits.device)
    return torch.where(greedy, logits.argmax(dim=-1), sampled)
