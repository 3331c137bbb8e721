"""What generation returns, shaped as vLLM's outputs so that code written for it reads ours."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar

import numpy as np

from vacpack.lora.request import LoRARequest

if TYPE_CHECKING:
    import torch  # imported by what makes a PoolingOutput, not by readers of outputs

PooledOutput = TypeVar("PooledOutput")


class RequestOutputKind(enum.Enum):
    """What each engine output carries, as in vLLM."""

    CUMULATIVE = 0  # everything so far, at every step
    DELTA = 1  # only what is new since the last output: for streaming
    FINAL_ONLY = 2  # one output, when the request has finished


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


# One position's candidates: token id -> Logprob (the chosen token plus the top-k).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None  # "stop" or "length" once finished
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock seconds (time.perf_counter) of a request's milestones."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0

    @property
    def time_to_first_token_s(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(0.0))
    # Prompt tokens whose KV came from the prefix cache, not computed for this request (vLLM's
    # name): those of its first sample's first admission.
    num_cached_tokens: int = 0
    lora_request: LoRARequest | None = None  # the adapter it ran, as vLLM reports it


# ---------------------------------------------------------------- corpus jobs


@dataclass(frozen=True)
class PoolingOutput:
    """What LLM.encode gives an input: [tokens, dims] for token_embed, [dims] for embed,
    [labels] for classify; float32 on the CPU."""

    data: torch.Tensor


@dataclass(frozen=True)
class PoolingRequestOutput(Generic[PooledOutput]):
    """One input's result of a pooling job, as vLLM shapes them all: `out.outputs` is a
    PoolingOutput (LLM.encode) or the embed, classify or score job's own output."""

    request_id: str
    # The input's tokens as the model read them (a scored pair's: both texts').
    prompt_token_ids: list[int]
    outputs: PooledOutput
    finished: bool = True


@dataclass(frozen=True)
class EmbeddingOutput:
    embedding: list[float]


@dataclass(frozen=True)
class EmbeddingRequestOutput(PoolingRequestOutput[EmbeddingOutput]):
    """One input's embedding: `out.outputs.embedding`, as in vLLM."""


@dataclass(frozen=True)
class ClassificationOutput:
    # One per label: a softmax, or each label's sigmoid for one label (a cross-encoder's score)
    # or multi-label classification, as transformers' text-classification pipeline.
    probs: list[float]
    label: str  # the most probable label's name
    labels: list[str]  # the names of probs' entries, from the model config's id2label


@dataclass(frozen=True)
class ClassificationRequestOutput(PoolingRequestOutput[ClassificationOutput]):
    """One input's label probabilities: `out.outputs.probs`, as in vLLM."""


@dataclass(frozen=True)
class ScoringOutput:
    score: float  # a cross-encoder's relevance (sigmoid of its logit), or a cosine similarity


@dataclass(frozen=True)
class ScoringRequestOutput(PoolingRequestOutput[ScoringOutput]):
    """One (text_1, text_2) pair's score: `out.outputs.score`, as in vLLM."""


@dataclass(frozen=True)
class LoglikelihoodOutput:
    """The log-likelihood of a document, or of a continuation given its context.

    `logprob` is the sum of `num_tokens` token log-probabilities (natural log). `is_greedy` is
    whether every scored token was the model's most likely one (continuations only).
    """

    index: int
    logprob: float
    num_tokens: int
    is_greedy: bool | None = None
    token_logprobs: list[float] | None = None


def embeddings_array(outputs: list[EmbeddingRequestOutput]) -> np.ndarray:
    """The embeddings of `LLM.embed` as one [num_inputs, dim] float32 numpy array."""
    return np.asarray([o.outputs.embedding for o in outputs], dtype=np.float32)
