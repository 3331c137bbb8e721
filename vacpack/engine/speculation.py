"""Speculative decoding: several tokens of a decode per step where the model agrees with a draft.

A decoding sequence whose rows depend on the tokens before them alone (see `speculates`) gets
draft tokens from n-gram prompt lookup (ngram_proposer.py). Its step then computes its last
token and the drafts together, like a short prefill chunk, and checks each draft against the
model's distribution after the tokens before it (draft_verification.py: greedy rows by their
argmax, sampled ones by rejection sampling). The drafts are kept up to the first one rejected,
and the model's own token at that point follows them: 1 to 1 + len(drafts) tokens for one step,
the very tokens one-at-a-time greedy decoding would have produced, and for sampled sequences
tokens drawn from the very same distributions. The keys and values the rejected drafts wrote
are past the sequence's computed length, so later steps overwrite them.

The cost: on a CPU, or a GPU at small batches, a decode step is bound by reading the weights, and
a few more rows cost little; when the drafts are rejected, that little is lost. At larger
batches the rows cost more (on a 2-core Zen 3, 8 sequences with 4 rejected drafts each ran at
0.43x), so each sequence drafts by its own record (DraftState): one token more than its last
step accepted, and after a step that accepted none it pauses for 1, 2, 4, ... steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from vacpack.engine.ngram_proposer import propose_ngram_drafts

if TYPE_CHECKING:
    from vacpack.engine.request import Sequence

# The longest pause of a sequence whose drafts keep failing: how late it may start drafting
# again once its text begins to repeat.
MAX_PAUSE_STEPS = 16


@dataclass
class DraftState:
    """A sequence's drafting record: how many drafts its next step may take, and its pause
    after drafts that were all rejected."""

    max_drafts: int | None = None  # one more than the last step accepted; None: no record yet
    num_steps_paused: int = 0  # decode steps left without drafts
    pause_steps: int = 0  # the last pause's length (0 after a step that accepted a draft)

    def record(self, num_accepted: int) -> None:
        """A verified step accepted `num_accepted` drafts."""
        self.max_drafts = num_accepted + 1
        if num_accepted:
            self.pause_steps = 0
        else:
            self.pause_steps = min(2 * self.pause_steps or 1, MAX_PAUSE_STEPS)
            self.num_steps_paused = self.pause_steps

    def allows_drafts(self) -> bool:
        """Whether this decode step may draft (counting down a pause)."""
        if self.num_steps_paused:
            self.num_steps_paused -= 1
            return False
        return True


@dataclass(frozen=True)
class SpeculationConfig:
    num_speculative_tokens: int  # drafts per step, at most
    prompt_lookup_min: int
    prompt_lookup_max: int

    def drafts(self, sequence: Sequence, budget: int) -> tuple[int, ...]:
        """Draft tokens for a decoding sequence, within the step's token `budget` (its last
        token included) and its limits (max_tokens, the context): none where it does not
        speculate or nothing in its tokens repeats."""
        state = sequence.draft_state
        if not speculates(sequence) or not state.allows_drafts():
            return ()
        room = sequence.max_total_tokens - sequence.num_tokens
        max_tokens = sequence.params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - sequence.num_output_tokens)
        # Each accepted draft and the model's token after them are output tokens.
        max_drafts = min(self.num_speculative_tokens, budget - 1, room - 1)
        if state.max_drafts is not None:
            max_drafts = min(max_drafts, state.max_drafts)
        return tuple(
            propose_ngram_drafts(
                sequence.token_ids, self.prompt_lookup_min, self.prompt_lookup_max, max_drafts
            )
        )


def speculates(sequence: Sequence) -> bool:
    """True when each row's distribution depends on the tokens before it alone (no
    penalties, token constraints or stop tokens held back for min_tokens), so that
    a draft is checked against it: greedy rows by their argmax, sampled ones by rejection
    sampling (draft_verification.py). Seeded requests do not speculate: their draws, taken
    by drafts that vary with the batch (its budget, free pages), would not be reproducible."""
    params = sequence.params
    return (
        (params.is_greedy or params.seed is None)
        and not params.has_penalties
        and not params.constrains_tokens
        and sequence.constraints is None
        and sequence.num_output_tokens >= params.min_tokens
        and not sequence.num_pending_tokens
    )


def accepted_tokens(draft_token_ids: tuple[int, ...], target_token_ids: list[int]) -> list[int]:
    """The drafts up to the first the model would not have chosen, then the model's token."""
    num_accepted = 0
    for draft, target in zip(draft_token_ids, target_token_ids, strict=False):
        if draft != target:
            break
        num_accepted += 1
    return [*draft_token_ids[:num_accepted], target_token_ids[num_accepted]]
