"""One sequence being generated: its tokens, its progress through the model, its KV pages."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from vacpack.outputs import PositionLogprobs, RequestMetrics
from vacpack.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """A single sequence. A user request with n > 1 becomes n of these, one per sample."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stop_token_ids: frozenset[int]  # EOS ids (unless ignore_eos) and params.stop_token_ids
    max_total_tokens: int  # prompt + output may not exceed this (max_model_len)
    generator: torch.Generator | None
    detokenizer: Any
    metrics: RequestMetrics
    token_ids: list[int] = field(init=False)  # prompt then output, the model's whole input
    num_computed_tokens: int = 0  # tokens whose keys and values are in the KV cache
    page_table: list[int] = field(default_factory=list)
    # Chained content hashes of the full pages computed so far (prefix caching).
    page_hashes: list[int] = field(default_factory=list)
    # The first of this request's n samples: the others wait for its prompt pages to be cached.
    prefix_leader: Request | None = None
    num_cached_prompt_tokens: int = 0  # prompt tokens found in the prefix cache
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    # For DELTA outputs: how much of the output has been reported already.
    num_reported_tokens: int = 0
    finish_reported: bool = False

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]  # the first prompt token has no context to score it

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        """True while some prompt positions still lack their logprobs."""
        return (
            self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens
        )
