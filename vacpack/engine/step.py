"""What passes between the scheduler and the model runner: a step's chunks and its results."""

from __future__ import annotations

from dataclasses import dataclass, field

from vacpack.engine.logprob_gather import TokenLogprobs
from vacpack.engine.request import Sequence
from vacpack.engine.sampler import SamplerOutput


@dataclass(frozen=True)
class ScheduledChunk:
    """`num_new_tokens` tokens of a sequence from position `start` on, computed in one step."""

    sequence: Sequence
    start: int
    num_new_tokens: int
    samples: bool  # the chunk reaches the end of the known tokens: a new one is sampled
    # Speculative decoding: draft tokens after the sequence's last token, computed with it and
    # verified against the model's own choices (speculation.py); the chunk's last
    # len(draft_token_ids) tokens.
    draft_token_ids: tuple[int, ...] = ()

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens


@dataclass(frozen=True)
class PromptLogprobResult:
    sequence: Sequence
    first_position: int  # the logprobs are of prompt tokens first_position + 1, ...
    logprobs: TokenLogprobs  # on the host


@dataclass(frozen=True)
class VerifiedDrafts:
    """A speculating sequence's drafts and the model's greedy token after its last token and
    after each draft token (one more than the drafts)."""

    sequence: Sequence
    draft_token_ids: tuple[int, ...]
    target_token_ids: list[int]
    # Each row's logprob of its target and its top candidates, where the sequence wants them.
    logprobs: TokenLogprobs | None = None


@dataclass(frozen=True)
class StepResult:
    """A step's results on the host."""

    sampled_sequences: list[Sequence]
    sampled_token_ids: list[int]
    sampler_output: SamplerOutput | None  # host copies, for logprobs
    prompt_logprobs: list[PromptLogprobResult]
    num_tokens: int
    num_decode_tokens: int
    num_padded_slots: int = 0
    # Tensor parallel on gloo: rank 0's host seconds inside collectives during the step.
    collective_s: float | None = None
    verified: list[VerifiedDrafts] = field(default_factory=list)
