"""What an LLM answers through the OpenAI API: text generation, embeddings, scores.

- Generation: decoders with an LM head.
- Embeddings: every model that is not a classifier. Encoders and bare decoder bodies are
  embedding models; a generative decoder embeds too, as vLLM's `embed` does for decoders (its
  last token, normalized, unless sentence-transformers files say otherwise).
- Scores (/score, /rerank): a cross-encoder (a classifier with one label) scores each pair
  whole; any embedding-capable model scores the cosine similarity of the two embeddings.
- Classification (/classify): a sequence classifier's label probabilities, for any number of
  labels.
- Pooling (/pooling): LLM.encode's tasks, per-token embeddings (token_embed) included.
Requests of a kind a model does not serve get a 400 naming the reason.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vacpack.corpus.scoring import TextPair, joins_pair_texts
from vacpack.corpus.truncation import pooling_tokens_to_keep
from vacpack.engine.engine import LLMEngine
from vacpack.llm import LLM
from vacpack.lora.request import LoRARequest
from vacpack.models.base import SequenceClassifier
from vacpack.models.pooling import check_dimensions
from vacpack.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    ScoringRequestOutput,
)
from vacpack.pooling_params import PoolingParams

EmbedInput = str | list[int]
# Every function also takes truncate_prompt_tokens (the tokens each input keeps; None: all).
# Texts or token-id lists in (and the Matryoshka dimensions, None for all), one output per
# input out, in order.
EmbedFunction = Callable[[list[EmbedInput], int | None, int | None], list[EmbeddingRequestOutput]]
# (text_1, text_2) pairs in (and whether a cross-encoder's sigmoid applies), one score each out.
ScoreFunction = Callable[[list[TextPair], bool, int | None], list[ScoringRequestOutput]]
# Texts or token-id lists in, their label probabilities out, in order.
ClassifyFunction = Callable[[list[EmbedInput], int | None], list[ClassificationRequestOutput]]
# Texts or token-id lists in (and LLM.encode's pooling task and parameters), one tensor each out.
EncodeFunction = Callable[
    [list[EmbedInput], str, PoolingParams, int | None], list[PoolingRequestOutput]
]


@dataclass(frozen=True)
class PoolingFunctions:
    """What answers the embedding and scoring endpoints for one model; None where it cannot."""

    embed: EmbedFunction | None
    score: ScoreFunction | None
    classify: ClassifyFunction | None
    encode: EncodeFunction
    default_pooling_task: str  # /pooling's task when a request names none
    check_dimensions: Callable[[int], None]  # ValueError if embeddings may not be cut to it
    # (kind: "embed", "score" or "classify", truncate_prompt_tokens) -> ValueError naming the
    # field and its limits if this model's inputs of that kind may not be cut to it.
    check_truncation: Callable[[str, int], None]
    no_embed_reason: str
    no_score_reason: str
    no_classify_reason: str


def generation_engine(llm: LLM) -> LLMEngine | None:
    """The LLM's generation engine, or None for a model that cannot generate."""
    return llm.engine if llm.loaded.is_decoder else None


def load_served_adapters(
    llm: LLM, engine: LLMEngine | None, adapters: Mapping[str, LoRARequest]
) -> None:
    """Loads the adapters named on the command line before any request: a bad one stops the
    start with its reason (ValueError)."""
    if not adapters:
        return
    if engine is None or not llm.config.enable_lora:
        raise ValueError("--lora-modules needs a generating model started with --enable-lora")
    for adapter in adapters.values():
        engine.add_adapter(adapter)


def pooling_functions(llm: LLM) -> PoolingFunctions:
    loaded = llm.loaded
    config = loaded.config
    architecture = config.architecture
    is_classifier = isinstance(loaded.model, SequenceClassifier)
    num_labels = int(getattr(config, "num_labels", 0) or 0)

    def embed(
        inputs: list[EmbedInput], dimensions: int | None, truncate_prompt_tokens: int | None
    ) -> list[EmbeddingRequestOutput]:
        return llm.embed(
            inputs,
            dimensions=dimensions,
            use_tqdm=False,
            truncate_prompt_tokens=truncate_prompt_tokens,
        )

    def score(
        pairs: list[TextPair], use_activation: bool, truncate_prompt_tokens: int | None
    ) -> list[ScoringRequestOutput]:
        texts_1, texts_2 = [a for a, _ in pairs], [b for _, b in pairs]
        return llm.score(
            texts_1,
            texts_2,
            use_activation=use_activation,
            use_tqdm=False,
            truncate_prompt_tokens=truncate_prompt_tokens,
        )

    def classify(
        inputs: list[EmbedInput], truncate_prompt_tokens: int | None
    ) -> list[ClassificationRequestOutput]:
        return llm.classify(inputs, use_tqdm=False, truncate_prompt_tokens=truncate_prompt_tokens)

    def encode(
        inputs: list[EmbedInput],
        task: str,
        params: PoolingParams,
        truncate_prompt_tokens: int | None,
    ) -> list[PoolingRequestOutput]:
        return llm.encode(
            inputs,
            params,
            pooling_task=task,
            use_tqdm=False,
            truncate_prompt_tokens=truncate_prompt_tokens,
        )

    def check(dimensions: int) -> None:
        check_dimensions(dimensions, config.hidden_size, loaded.hf_config)

    def check_truncation(kind: str, truncate_prompt_tokens: int) -> None:
        # Only a cross-encoder's scores read pairs joined by the tokenizer; an embedding model
        # scores each text alone (the rule the jobs apply: CorpusTask.keep_input_tokens).
        reads_pairs = kind == "score" and is_classifier and not joins_pair_texts(loaded.model)
        pooling_tokens_to_keep(
            truncate_prompt_tokens, loaded.max_model_len, loaded.tokenizer, reads_pairs
        )

    serves_score = not is_classifier or num_labels == 1
    return PoolingFunctions(
        embed=None if is_classifier else embed,
        score=score if serves_score else None,
        classify=classify if is_classifier else None,
        encode=encode,
        default_pooling_task="classify" if is_classifier else "token_embed",
        check_dimensions=check,
        check_truncation=check_truncation,
        no_embed_reason=(
            f"this model does not serve embeddings: {architecture} is a classifier"
            + ("; use /v1/score or /v1/rerank" if serves_score else "")
        ),
        no_score_reason=(
            f"this model does not serve scores: {architecture} has {num_labels} labels, and "
            "scoring needs a cross-encoder with one label or an embedding model"
        ),
        no_classify_reason=(
            f"this model does not classify: {architecture} has no classification head (a "
            "*ForSequenceClassification checkpoint has one)"
        ),
    )


def run_grouped(
    function: Callable[[list[Any]], list[Any]], groups: Sequence[list[Any]]
) -> list[list[Any] | ValueError]:
    """Runs several requests' inputs as one packed job; each request gets its own outputs.

    When the joint job fails (some input is bad), each request is run alone, so that only the
    request with the bad input gets the error.
    """
    inputs = [item for group in groups for item in group]
    try:
        outputs = function(inputs)
    except ValueError as error:
        if len(groups) == 1:
            return [error]
        return [_run_alone(function, group) for group in groups]
    results: list[list[Any] | ValueError] = []
    start = 0
    for group in groups:
        results.append(outputs[start : start + len(group)])
        start += len(group)
    return results


def _run_alone(
    function: Callable[[list[Any]], list[Any]], group: list[Any]
) -> list[Any] | ValueError:
    try:
        return function(group)
    except ValueError as error:
        return error
