"""A user request and its sequences.

A `Request` is what a user asked for: a prompt and sampling parameters. It runs as `n`
`Sequence`s (one per sample, `SamplingParams.n`), each with its own tokens, progress through the
model and KV pages; the scheduler schedules sequences and gathers them back per request.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from vacpack.detokenizer import RequestDetokenizer
from vacpack.engine.request_seeds import make_request_generator
from vacpack.engine.sampler import SamplingRow
from vacpack.engine.speculation import DraftState
from vacpack.kvcache.page_pool import page_hashes
from vacpack.lora.request import LoRARequest
from vacpack.outputs import PositionLogprobs, RequestMetrics, RequestOutputKind
from vacpack.sampling import SamplingParams
from vacpack.structured.constraints import SequenceConstraints


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One sample of a request: its tokens, its progress through the model, its KV pages."""

    request: Request = field(repr=False)  # the request this is sample `index` of
    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    stop_token_ids: frozenset[int]  # EOS ids (unless ignore_eos) and params.stop_token_ids
    max_total_tokens: int  # prompt + output may not exceed this (max_model_len)
    generator: torch.Generator | None
    detokenizer: RequestDetokenizer
    metrics: RequestMetrics
    # Prompt then output, the model's whole input. The last `num_pending_tokens` entries are
    # placeholders (negative ids) for tokens sampled by a step still running on the device:
    # a sequence's length advances when its step is scheduled, and with async scheduling the
    # next step reads the real id on the device before the host knows it.
    token_ids: list[int] = field(init=False)
    num_pending_tokens: int = 0
    num_computed_tokens: int = 0  # tokens whose keys and values are (being) written to the cache
    page_table: list[int] = field(default_factory=list)
    # Leading page-table entries whose pages went back to the pool, all layers' sliding windows
    # having passed them (window_pages.py); the entries stay, as RELEASED_PAGE.
    num_released_pages: int = 0
    # Chained content hashes of the full pages computed so far (prefix caching).
    page_hashes: list[int] = field(default_factory=list)
    num_cached_prompt_tokens: int = 0  # prompt tokens found in the prefix cache
    # The first prompt position whose logprob is wanted: positions before it may come from
    # the prefix cache (continuation scoring needs only the continuation's logprobs).
    prompt_logprobs_start: int = 1
    # A grammar, allowed / banned tokens, biases (vacpack.structured); None when unconstrained.
    constraints: SequenceConstraints | None = None
    # Its rows of the sampler's input without penalties, by whether stop tokens are still
    # suppressed (model_runner._sampling_row): the same every step.
    sampling_rows: dict[bool, SamplingRow] = field(default_factory=dict, repr=False)
    # Page hashes this sequence has announced as being computed and not yet indexed.
    in_flight_hashes: set[int] = field(default_factory=set, repr=False)
    # Speculative decoding: how many drafts it takes, after how its drafts fared.
    draft_state: DraftState = field(default_factory=DraftState, repr=False)
    lora_id: int = 0  # the LoRA adapter it runs (0: the base model alone)
    _token_page_hashes: list[int] = field(default_factory=list, repr=False)
    status: SequenceStatus = SequenceStatus.WAITING
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
            # The first prompt token has no context to score it; others may not be wanted.
            self.prompt_logprobs = [None] * max(self.prompt_logprobs_start, 1)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids the host knows: all but the pending placeholders."""
        return len(self.token_ids) - self.num_pending_tokens

    @property
    def output_token_ids(self) -> list[int]:
        """The output tokens known so far (pending placeholders left out)."""
        return self.token_ids[self.num_prompt_tokens : self.num_known_tokens]

    @property
    def num_output_tokens(self) -> int:
        """Output tokens known so far."""
        return self.num_known_tokens - self.num_prompt_tokens

    @property
    def num_scheduled_output_tokens(self) -> int:
        """Output tokens sampled or being sampled: what the next sample's index depends on."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def all_tokens_scheduled(self) -> bool:
        """True when the steps already launched produce the request's last possible token, so
        it will finish by length when they are read and must not be scheduled again."""
        max_tokens = self.params.max_tokens
        return self.num_pending_tokens > 0 and (
            (max_tokens is not None and self.num_scheduled_output_tokens >= max_tokens)
            or self.num_tokens >= self.max_total_tokens
        )

    def add_pending_token(self, placeholder: int) -> None:
        """Appends a placeholder for a token being sampled by a launched step."""
        self.token_ids.append(placeholder)
        self.num_pending_tokens += 1

    def resolve_pending_token(self, token_id: int) -> None:
        """The oldest pending token turns out to be `token_id` (steps are read in order)."""
        assert self.num_pending_tokens > 0, "no token is being sampled"
        self.token_ids[self.num_known_tokens] = token_id
        self.num_pending_tokens -= 1

    def drop_pending_tokens(self) -> None:
        """A finished request forgets tokens sampled past its end by steps already launched."""
        if self.num_pending_tokens:
            del self.token_ids[-self.num_pending_tokens :]
            self.num_pending_tokens = 0

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def full_page_hashes(self, page_size: int) -> list[int]:
        """Chained hashes of every full page of known tokens, extended as the tokens grow."""
        hashes = self._token_page_hashes
        num_full_pages = self.num_known_tokens // page_size
        if len(hashes) < num_full_pages:
            start = len(hashes) * page_size
            hashes.extend(
                page_hashes(
                    self.token_ids[start : num_full_pages * page_size],
                    page_size,
                    hashes[-1] if hashes else _chain_seed(self.lora_id),
                )
            )
        return hashes[:num_full_pages]

    @property
    def max_cached_tokens(self) -> int:
        """How much of the sequence may come from the prefix cache: never the last token (its
        logits are needed), nor a prompt position whose logprob is wanted."""
        limit = self.num_tokens - 1
        if self.prompt_logprobs is not None and self.wants_prompt_logprobs:
            limit = min(limit, len(self.prompt_logprobs) - 1)
        return limit

    @property
    def wants_prompt_logprobs(self) -> bool:
        """True while some prompt positions still lack their logprobs."""
        return (
            self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens
        )


@dataclass(eq=False)
class Request:
    """A user request: one prompt, `n` sequences sampled from it."""

    request_id: str
    prompt: str | None
    metrics: RequestMetrics
    sequences: list[Sequence] = field(default_factory=list, repr=False)
    num_unfinished: int = 0  # sequences not finished yet
    lora_request: LoRARequest | None = None  # its adapter, reported in its outputs
    # Priority scheduling: lower goes first; ties go by arrival (the scheduler's count).
    priority: int = 0
    arrival_index: int = 0

    def add_sequence(self, sequence: Sequence) -> None:
        self.sequences.append(sequence)
        self.num_unfinished += 1

    @property
    def is_finished(self) -> bool:
        return self.num_unfinished == 0

    @property
    def params(self) -> SamplingParams:
        """The first sample's parameters (samples differ only in their seeds)."""
        return self.sequences[0].params


def check_priority(priority: int, scheduling_policy: str) -> None:
    """Raises ValueError for a priority the engine's scheduling policy cannot honour."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority must be an integer, got {priority!r}")
    if priority != 0 and scheduling_policy != "priority":
        raise ValueError(
            f"got priority {priority}, but priority scheduling is not enabled: start the "
            'engine with scheduling_policy="priority" (--scheduling-policy priority)'
        )


def check_prompt(prompt_token_ids: list[int], vocab_size: int, max_model_len: int) -> None:
    """Raises ValueError for a prompt no engine of this model can run."""
    if not prompt_token_ids:
        raise ValueError("the prompt is empty: give at least one token")
    bad = [t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < vocab_size)]
    if bad:
        raise ValueError(f"prompt token ids must be integers in [0, {vocab_size}); got {bad[:5]}")
    if len(prompt_token_ids) >= max_model_len:
        raise ValueError(
            f"the prompt has {len(prompt_token_ids)} tokens, but the context is "
            f"max_model_len={max_model_len} tokens: at most {max_model_len - 1} "
            "prompt tokens leave room for one output token"
        )


def _chain_seed(lora_id: int) -> int | None:
    """The parent hash of a sequence's first page: an adapter's keys and values differ from
    the base model's, so its pages are cached apart, under a chain seeded by its id."""
    return hash(("lora", lora_id)) if lora_id else None


def build_request(
    request_id: str,
    prompt: str | None,
    prompt_token_ids: list[int],
    params: SamplingParams,
    *,
    tokenizer: PreTrainedTokenizerBase,
    stop_token_ids: frozenset[int],
    max_total_tokens: int,
    device: torch.device,
    prompt_logprobs_start: int = 1,
    lora_id: int = 0,
) -> Request:
    """A request and its `params.n` sequences, each with its own detokenizer and seed."""
    request = Request(request_id, prompt, RequestMetrics(arrival_time=time.perf_counter()))
    for index in range(params.n):
        # Each of the n samples gets its own seed, so that they differ, reproducibly.
        sample_params = params.child_params(index)
        generator = None
        if sample_params.seed is not None:
            generator = make_request_generator(sample_params.seed, device)
        request.add_sequence(
            Sequence(
                request=request,
                index=index,
                prompt_token_ids=list(prompt_token_ids),
                params=sample_params,
                stop_token_ids=stop_token_ids,
                max_total_tokens=max_total_tokens,
                generator=generator,
                detokenizer=RequestDetokenizer(
                    tokenizer,
                    stop_strings=params.stop or (),
                    include_stop_str_in_output=params.include_stop_str_in_output,
                    skip_special_tokens=params.skip_special_tokens,
                    spaces_between_special_tokens=params.spaces_between_special_tokens,
                    # Nobody reads the text before the end: decoded once, at the end.
                    text_at_finish=params.output_kind is RequestOutputKind.FINAL_ONLY
                    and not params.stop,
                ),
                metrics=RequestMetrics(arrival_time=request.metrics.arrival_time),
                prompt_logprobs_start=prompt_logprobs_start,
                lora_id=lora_id,
            )
        )
    return request
