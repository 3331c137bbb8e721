"""Scoring text pairs, as vLLM's `score` does: a cross-encoder reads each pair whole; an
embedding model (or a decoder) embeds both texts and compares them by cosine similarity.

A cross-encoder pair is one packed document. An encoder reads it as its tokenizer joins a pair
(`[CLS] A [SEP] B [SEP]`, or XLM-R's `<s> A </s></s> B </s>`) with each token's segment in the
forward's token_type_ids, rebuilt per bin from each document's first-segment length; a decoder
classifier reads the two texts joined, without a separator, as vLLM's "LLM as reranker" does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from vacpack.corpus.packing import Document, DocumentError
from vacpack.corpus.tasks import CorpusTask
from vacpack.models.base import SequenceClassifier
from vacpack.outputs import EmbeddingRequestOutput, ScoringOutput, ScoringRequestOutput
from vacpack.runtime import LoadedModel

TextPair = tuple[str, str]


def pair_inputs(
    data_1: str | Sequence[str],
    data_2: str | Sequence[str],
    names: tuple[str, str] = ("text_1", "text_2"),
) -> list[TextPair]:
    """The pairs to score: 1:1, one text_1 against every text_2 (1:N), or pairwise (N:N).

    `names` are the two sides' names in error messages (a request's own field names).
    """
    first_name, second_name = names
    texts_1 = [data_1] if isinstance(data_1, str) else list(data_1)
    texts_2 = [data_2] if isinstance(data_2, str) else list(data_2)
    for name, texts in ((first_name, texts_1), (second_name, texts_2)):
        if not texts:
            raise ValueError(f"{name} must not be empty: give at least one text")
        for index, text in enumerate(texts):
            where = f"{name} {index}" if len(texts) > 1 else name
            if not isinstance(text, str):
                raise ValueError(f"{where} must be a string, got {type(text).__name__}")
            if not text.strip():
                raise ValueError(f"{where} is empty")
    if len(texts_1) > 1 and len(texts_1) != len(texts_2):
        raise ValueError(
            f"got {len(texts_1)} {first_name} and {len(texts_2)} {second_name}: the lengths "
            "must be 1:1, 1:N or N:N"
        )
    if len(texts_1) == 1:
        texts_1 = texts_1 * len(texts_2)
    return list(zip(texts_1, texts_2, strict=True))


class CrossEncoderTask(CorpusTask):
    """One score per pair from a one-label classifier: sigmoid of its logit by default, as
    sentence-transformers' CrossEncoder scores; the raw logit with use_activation=False."""

    name = "score"

    def __init__(
        self, loaded: LoadedModel, truncate: bool = False, use_activation: bool = True
    ) -> None:
        super().__init__(loaded, truncate)
        model = loaded.model
        if not hasattr(model, "classify"):
            raise ValueError(
                f"model {loaded.engine_config.model!r} ({loaded.config.architecture}) is not a "
                "cross-encoder (*ForSequenceClassification)"
            )
        num_labels = int(loaded.config.num_labels)
        if num_labels != 1:
            raise ValueError(
                f"scoring needs a cross-encoder with one label; {loaded.config.architecture} "
                f"has {num_labels} labels (classify gives their probabilities)"
            )
        self.use_activation = use_activation
        self.joins_texts = joins_pair_texts(model)
        self.reads_pairs = not self.joins_texts
        # XLM-R has a single token type, and its tokenizer returns none.
        self.reads_token_types = (
            not self.joins_texts and getattr(loaded.config, "type_vocab_size", 1) > 1
        )

    def encode(self, index: int, item: Any) -> Document:
        (result,) = self.encode_batch([(index, item)])
        if isinstance(result, DocumentError):
            raise ValueError(result.message)
        return result

    def encode_batch(self, items: Sequence[tuple[int, Any]]) -> list[Document | DocumentError]:
        """All well-formed pairs in one tokenizer call; a malformed one becomes an error."""
        problems = {index: _pair_problem(item) for index, item in items}
        good = [(index, item) for index, item in items if problems[index] is None]
        encoded = self._tokenize_pairs([item for _, item in good]) if good else {}
        position_of = {index: position for position, (index, _) in enumerate(good)}
        results: list[Document | DocumentError] = []
        for index, _ in items:
            problem = problems[index]
            if problem is not None:
                results.append(DocumentError(index, problem))
                continue
            position = position_of[index]
            token_ids, num_first = encoded["input_ids"][position], encoded["num_first"][position]
            try:
                results.append(Document(index, self._checked(token_ids), payload=num_first))
            except ValueError as error:
                results.append(DocumentError(index, str(error)))
        return results

    def _tokenize_pairs(self, pairs: list[TextPair]) -> dict[str, list[Any]]:
        truncation: dict[str, Any] = {
            "truncation": self.truncate,
            "max_length": self.max_len if self.truncate else None,
        }
        if self.joins_texts:
            encoded = self.tokenizer([a + b for a, b in pairs], **truncation)
            return {"input_ids": encoded["input_ids"], "num_first": [None] * len(pairs)}
        # The tokenizer truncates the longer text first, keeping both texts' special tokens.
        encoded = self.tokenizer([a for a, _ in pairs], [b for _, b in pairs], **truncation)
        type_lists = encoded.get("token_type_ids") if self.reads_token_types else None
        if type_lists is None:
            return {"input_ids": encoded["input_ids"], "num_first": [None] * len(pairs)}
        return {"input_ids": encoded["input_ids"], "num_first": [_num_first(t) for t in type_lists]}

    def token_type_ids(
        self,
        documents: Sequence[Document | None],
        seq_lens: Sequence[int],
        positions: torch.Tensor,
    ) -> torch.Tensor | None:
        if not self.reads_token_types:
            return None
        # Token t is of type 1 from its document's first second-segment position on; a
        # padding segment is all type 0.
        first_second = [
            seq_len if doc is None or doc.payload is None else doc.payload
            for doc, seq_len in zip(documents, seq_lens, strict=True)
        ]
        boundary = torch.repeat_interleave(
            torch.tensor(first_second, dtype=torch.int64), torch.tensor(seq_lens)
        ).to(positions.device, non_blocking=True)
        return (positions >= boundary).long()

    def process(
        self, documents: Sequence[Document], seq_lens: Sequence[int], hidden: torch.Tensor
    ) -> list[ScoringRequestOutput]:
        model = self.loaded.model
        assert isinstance(model, SequenceClassifier), "checked when the task was made"
        logits = model.classify(hidden, seq_lens)[:, 0].float()
        scores = torch.sigmoid(logits) if self.use_activation else logits
        return [
            ScoringRequestOutput(str(doc.index), doc.token_ids.tolist(), ScoringOutput(score))
            for doc, score in zip(documents, scores.cpu().tolist(), strict=True)
        ]


def joins_pair_texts(model: object) -> bool:
    """Whether a cross-encoder reads a pair as its two texts joined (a decoder classifier, as
    vLLM's "LLM as reranker"), not as its tokenizer's pair with separators (an encoder)."""
    return bool(getattr(model, "is_causal", False))


def cosine_scores(
    pairs: Sequence[TextPair], embedded: dict[str, EmbeddingRequestOutput]
) -> list[ScoringRequestOutput]:
    """Each pair's cosine similarity from the embeddings of its two texts."""
    first = torch.tensor([embedded[a].outputs.embedding for a, _ in pairs])
    second = torch.tensor([embedded[b].outputs.embedding for _, b in pairs])
    similarities = F.cosine_similarity(first, second, dim=-1).tolist()
    return [
        ScoringRequestOutput(
            str(index),
            embedded[a].prompt_token_ids + embedded[b].prompt_token_ids,
            ScoringOutput(similarity),
        )
        for index, ((a, b), similarity) in enumerate(zip(pairs, similarities, strict=True))
    ]


def _pair_problem(item: Any) -> str | None:
    if not (isinstance(item, (tuple, list)) and len(item) == 2):
        return f"expected a (text_1, text_2) pair, got {type(item).__name__}"
    for name, text in zip(("text_1", "text_2"), item, strict=True):
        if not isinstance(text, str):
            return f"{name} must be a string, got {type(text).__name__}"
        if not text.strip():
            return f"{name} is empty"
    return None


def _num_first(token_types: Sequence[int]) -> int:
    """Tokens of the first segment: the tokenizer's types are 0s, then 1s."""
    num_first = list(token_types).index(1) if 1 in token_types else len(token_types)
    if any(t != 1 for t in token_types[num_first:]):
        raise ValueError("the tokenizer's token_type_ids are not one run of 0s, then one of 1s")
    return num_first
