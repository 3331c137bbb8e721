"""A batch line as the engine takes it: its body checked as the server checks the request
(the same code, vacpack.openai_api), in the same order, and translated into a generation or a
pooling job."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from vacpack.batch.lines import BatchLine
from vacpack.batch.options import BatchOptions
from vacpack.lora.request import LoRARequest
from vacpack.openai_api.errors import bad_request
from vacpack.openai_api.pooling import (
    PreparedPooling,
    prepare_classify,
    prepare_embeddings,
    prepare_encode,
    prepare_rerank,
    prepare_score,
)
from vacpack.openai_api.protocol import (
    ChatCompletionRequest,
    ClassificationRequest,
    CompletionRequest,
    EmbeddingRequest,
    EncodeRequest,
    RerankRequest,
    ScoreRequest,
    parse_body,
)
from vacpack.openai_api.requests import (
    GENERATION_URLS,
    RESPONSE_ID_PREFIXES,
    PreparedGeneration,
    parse_generation,
    prepare_generation,
)
from vacpack.openai_api.responses import new_response_id
from vacpack.openai_api.served_model import (
    check_model,
    check_n,
    check_num_sequences,
    check_pooling_model,
)
from vacpack.openai_api.serving import PoolingFunctions
from vacpack.outputs import RequestOutputKind

RESPONSE_ID_PREFIXES_BY_URL = {
    **{url: RESPONSE_ID_PREFIXES[kind] for url, kind in GENERATION_URLS.items()},
    "/v1/embeddings": "embd",
    "/v1/score": "score",
    "/score": "score",
    "/v1/rerank": "rerank",
    "/rerank": "rerank",
    "/v1/classify": "classify",
    "/classify": "classify",
    "/v1/pooling": "pool",
    "/pooling": "pool",
}
PoolingRequest = (
    EmbeddingRequest | ScoreRequest | RerankRequest | ClassificationRequest | EncodeRequest
)
POOLING_REQUESTS: dict[str, type[PoolingRequest]] = {
    "/v1/embeddings": EmbeddingRequest,
    "/v1/score": ScoreRequest,
    "/score": ScoreRequest,
    "/v1/rerank": RerankRequest,
    "/rerank": RerankRequest,
    "/v1/classify": ClassificationRequest,
    "/classify": ClassificationRequest,
    "/v1/pooling": EncodeRequest,
    "/pooling": EncodeRequest,
}
BatchRequest = CompletionRequest | ChatCompletionRequest | PoolingRequest


@dataclass(frozen=True)
class ReadyLine:
    """A line translated for the engine: a generation, or an embedding, score or rerank job."""

    line: BatchLine
    response_id: str
    prepared: PreparedGeneration | None = None
    pooling: PreparedPooling | None = None

    @property
    def size(self) -> int:
        if self.prepared is not None:
            return len(self.prepared.prompts)
        return len(self.pooling.inputs) if self.pooling is not None else 0


@dataclass(frozen=True)
class LineTranslator:
    """What a line's checks and translation depend on: how the run was started."""

    options: BatchOptions
    model_name: str  # the model name lines may give (--served-model-name)
    adapters: Mapping[str, LoRARequest]  # --lora-modules, by name
    generates: bool  # whether the model has an LM head
    tokenizer: PreTrainedTokenizerBase
    max_model_len: int
    sampling_defaults: Mapping[str, Any]
    pooling: PoolingFunctions
    scheduling_policy: str = "fcfs"  # the engine's (EngineConfig.scheduling_policy)

    @staticmethod
    def response_id(line: BatchLine) -> str:
        return new_response_id(RESPONSE_ID_PREFIXES_BY_URL[line.url])

    def translate(self, line: BatchLine, response_id: str) -> ReadyLine:
        """The line checked as the server checks a request, in the same order; APIError for
        what the server would refuse."""
        request = parse_request(line)
        if isinstance(request, PoolingRequest):
            check_pooling_model(request.model, self.model_name, self.adapters)
            return ReadyLine(line, response_id, pooling=self._prepare_pooling(request, response_id))
        adapter = check_model(request.model, self.model_name, self.adapters)
        check_n(request.n, self.options.max_n)
        check_num_sequences(request.num_prompts, request.n, self.options.max_sequences_per_request)
        if not self.generates:
            raise bad_request("this model does not generate text: it has no LM head", "model")
        kind = RequestOutputKind.FINAL_ONLY  # one output per request: nothing built per step
        prepared = prepare_generation(
            request,
            self.tokenizer,
            self.max_model_len,
            kind,
            sampling_defaults=self.sampling_defaults,
            scheduling_policy=self.scheduling_policy,
        )
        prepared = dataclasses.replace(prepared, lora_request=adapter)
        return ReadyLine(line, response_id, prepared=prepared)

    def _prepare_pooling(self, request: PoolingRequest, response_id: str) -> PreparedPooling:
        name, functions = self.model_name, self.pooling
        if isinstance(request, EmbeddingRequest):
            return prepare_embeddings(request, functions, name)
        if isinstance(request, ClassificationRequest):
            return prepare_classify(request, functions, name, response_id)
        if isinstance(request, EncodeRequest):
            return prepare_encode(request, functions, name, response_id)
        if isinstance(request, ScoreRequest):
            return prepare_score(request, functions, name, response_id)
        return prepare_rerank(request, functions, name, response_id)


def parse_request(line: BatchLine) -> BatchRequest:
    """The line's body as its endpoint's request; APIError 400 if it is not one."""
    kind = GENERATION_URLS.get(line.url)
    if kind is not None:
        return parse_generation(kind, line.body)
    return parse_body(POOLING_REQUESTS[line.url], line.body)
