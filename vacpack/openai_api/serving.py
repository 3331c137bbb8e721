"""What an LLM answers through the OpenAI API: text generation (decoders) or embeddings.

An embedding model is an encoder without a classification head (e.g. a sentence-transformers
BERT); a decoder serves completions and chat. Requests of the other kind get a 400.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from vacpack.engine.engine import LLMEngine
from vacpack.llm import LLM
from vacpack.models.base import SequenceClassifier
from vacpack.outputs import EmbeddingRequestOutput

EmbedInput = str | list[int]
# Texts or token-id lists in, one EmbeddingRequestOutput per input out, in order.
EmbedFunction = Callable[[list[EmbedInput]], list[EmbeddingRequestOutput]]


def generation_engine(llm: LLM) -> LLMEngine | None:
    """The LLM's generation engine, or None for a model that cannot generate."""
    return llm.engine if llm.loaded.is_decoder else None


def embed_function(llm: LLM) -> EmbedFunction | None:
    """What answers /v1/embeddings: LLM.embed for an embedding model, else None."""
    loaded = llm.loaded
    if loaded.is_decoder or isinstance(loaded.model, SequenceClassifier):
        return None

    def embed(inputs: list[EmbedInput]) -> list[EmbeddingRequestOutput]:
        return llm.embed(inputs, use_tqdm=False)

    return embed


def embed_groups(
    embed: EmbedFunction, groups: Sequence[list[EmbedInput]]
) -> list[list[EmbeddingRequestOutput] | ValueError]:
    """Embeds several requests' inputs in one packed job; each request gets its own outputs.

    When the joint job fails (some input is bad), each request is run alone, so that only the
    request with the bad input gets the error.
    """
    inputs = [item for group in groups for item in group]
    try:
        outputs = embed(inputs)
    except ValueError as error:
        if len(groups) == 1:
            return [error]
        return [_embed_alone(embed, group) for group in groups]
    results: list[list[EmbeddingRequestOutput] | ValueError] = []
    start = 0
    for group in groups:
        results.append(outputs[start : start + len(group)])
        start += len(group)
    return results


def _embed_alone(
    embed: EmbedFunction, group: list[EmbedInput]
) -> list[EmbeddingRequestOutput] | ValueError:
    try:
        return embed(group)
    except ValueError as error:
        return error
