"""The corpus tasks: how each turns inputs into documents and hidden states into results.

`encode` runs in the packer's background thread (tokenization stays off the device's critical
path) and raises ValueError for an input it cannot take: the job records that document as
failed and goes on. `process` gets the hidden states of whole documents, concatenated.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch

from vacpack.corpus.packing import Document, DocumentError
from vacpack.corpus.token_logprobs import score_tokens
from vacpack.corpus.truncation import pooling_tokens_to_keep
from vacpack.models.base import SequenceClassifier
from vacpack.models.pooling import (
    PoolingConfig,
    check_dimensions,
    pool,
    pooling_config_for,
    sentence_transformers_max_len,
    sentence_transformers_prompts,
)
from vacpack.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    LoglikelihoodOutput,
)
from vacpack.runtime import LoadedModel

# How to ask for over-long documents to be cut. A task cannot tell whether LLM.embed / classify /
# score / loglikelihood or the command line (embed, classify, loglikelihood) made it, and its
# per-document error reaches users of both, so it names both ways. (The server and run-batch
# put their request's field in its place: openai_api/pooling.py.)
TRUNCATE_HINT = "pass truncate=True (--truncate on the command line)"


class CorpusTask(ABC):
    name: str
    # Whether inputs are text pairs the tokenizer joins with its special tokens (cross-encoders).
    reads_pairs = False

    def __init__(self, loaded: LoadedModel, truncate: bool = False) -> None:
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.truncate = truncate
        self.max_len = loaded.max_model_len

    def keep_input_tokens(self, truncate_prompt_tokens: int | None) -> None:
        """Cuts every input to its first `truncate_prompt_tokens` tokens, special tokens kept
        (vLLM's pooling truncation: corpus/truncation.py); None keeps today's behaviour.
        ValueError, before any work, for a value this model cannot take."""
        keep = pooling_tokens_to_keep(
            truncate_prompt_tokens, self.loaded.max_model_len, self.tokenizer, self.reads_pairs
        )
        if keep is not None:
            # The tokenizer's own truncation (and _fit for token ids) then cuts at max_len.
            self.truncate = True
            self.max_len = min(self.max_len, keep)

    @abstractmethod
    def encode(self, index: int, item: Any) -> Document:
        """Tokenizes one input; raises ValueError saying what is wrong with it."""

    @abstractmethod
    def process(
        self, documents: Sequence[Document], seq_lens: Sequence[int], hidden: torch.Tensor
    ) -> list[Any]:
        """One result per document from its rows of `hidden` (documents back to back)."""

    def token_type_ids(
        self,
        documents: Sequence[Document | None],
        seq_lens: Sequence[int],
        positions: torch.Tensor,
    ) -> torch.Tensor | None:
        """Each token's segment for the forward over these segments; None: all of type 0."""
        return None

    def encode_batch(self, items: Sequence[tuple[int, Any]]) -> list[Document | DocumentError]:
        """`encode` over (index, input) pairs; an input it cannot take becomes an error record."""
        results: list[Document | DocumentError] = []
        for index, item in items:
            try:
                results.append(self.encode(index, item))
            except ValueError as error:
                results.append(DocumentError(index, str(error)))
        return results

    def _token_ids(self, index: int, item: Any, add_special_tokens: bool = True) -> list[int]:
        if isinstance(item, str):
            if not item.strip():
                raise ValueError("the document is empty")
            (token_ids,) = self._tokenize([item], add_special_tokens)
        elif isinstance(item, Sequence) and all(isinstance(t, int) for t in item):
            token_ids = list(item)
            # Checked here, in the packer's thread: an id past the embedding table would fail
            # the whole bin's forward, and with it every document sharing the bin.
            vocab_size = self.loaded.config.vocab_size
            outside = [t for t in token_ids if not 0 <= t < vocab_size]
            if outside:
                raise ValueError(
                    f"token ids must be integers in [0, {vocab_size}); got {outside[:5]}"
                )
        else:
            raise ValueError(f"expected text or a list of token ids, got {type(item).__name__}")
        return self._checked(token_ids)

    def _tokenize(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        # The tokenizer truncates (when asked) so that special tokens such as [SEP] stay.
        encoded = self.tokenizer(
            texts,
            add_special_tokens=add_special_tokens,
            truncation=self.truncate,
            max_length=self.max_len if self.truncate else None,
        )
        return list(encoded["input_ids"])

    def _checked(self, token_ids: list[int]) -> list[int]:
        if not token_ids:
            raise ValueError("the document is empty")
        return self._fit(token_ids)

    def _fit(self, token_ids: list[int]) -> list[int]:
        if len(token_ids) <= self.max_len:
            return token_ids
        if not self.truncate:
            raise ValueError(
                f"{len(token_ids)} tokens is longer than the model's context "
                f"({self.max_len}); {TRUNCATE_HINT} to cut it"
            )
        return token_ids[: self.max_len]


def resolve_pooling(
    loaded: LoadedModel,
    strategy: str | None = None,
    normalize: bool | None = None,
    dimensions: int | None = None,
) -> PoolingConfig:
    """The checkpoint's own pooling (sentence-transformers files), overridden where asked.

    Without sentence-transformers files, as vLLM's `embed` does: decoders (generative ones
    included) pool their last token, the one that has seen the whole text, encoders their first
    ([CLS]) token, and both normalize. `dimensions` cuts the vectors (Matryoshka); ValueError
    if the model's embeddings may not be cut to that size.
    """
    default_strategy = "last" if getattr(loaded.model, "is_causal", True) else "cls"
    config = pooling_config_for(
        loaded.model_dir, loaded.hf_config, default_strategy, default_normalize=True
    )
    if dimensions is not None:
        check_dimensions(dimensions, loaded.config.hidden_size, loaded.hf_config)
    return PoolingConfig(
        strategy or config.strategy,
        config.normalize if normalize is None else normalize,
        dimensions,
        config.include_prompt,
    )


def resolve_prompt(
    loaded: LoadedModel, prompt: str | None = None, prompt_name: str | None = None
) -> str:
    """The instruction prefix for texts to embed, as sentence-transformers picks it: `prompt`
    as given, else the checkpoint's prompt named `prompt_name`, else its default prompt."""
    if prompt is not None and prompt_name is not None:
        raise ValueError("give a prompt or a prompt_name, not both")
    if prompt is not None:
        return prompt
    prompts, default_name = sentence_transformers_prompts(loaded.model_dir)
    name = prompt_name or default_name
    if name is None:
        return ""
    if name not in prompts:
        known = ", ".join(sorted(prompts)) or "none"
        raise ValueError(f"the model has no prompt named {name!r} (its prompts: {known})")
    return prompts[name]


class WholeTextTask(CorpusTask):
    """A task whose documents are whole texts (or token ids) with the model's special tokens."""

    def encode(self, index: int, item: Any) -> Document:
        return Document(index, self._token_ids(index, item))

    def encode_batch(self, items: Sequence[tuple[int, Any]]) -> list[Document | DocumentError]:
        # One tokenizer call for all the texts: the per-call Python around the fast tokenizer
        # is paid once, and it holds the GIL that the forward's own Python needs between
        # kernels. Measured on E1's 5,000 texts (2-core CPU): 1.9 s batched against 3.2 s in a
        # call each; tokenizing a call each in the producer thread cost the job about 10% with
        # 256-token bins, against pre-tokenized input.
        texts = {index: item for index, item in items if isinstance(item, str) and item.strip()}
        # A tokenizer call with no texts fails in transformers: a batch of token-id lists.
        token_lists = self._tokenize(list(texts.values())) if texts else []
        tokenized = dict(zip(texts, token_lists, strict=True))
        results: list[Document | DocumentError] = []
        for index, item in items:
            try:
                token_ids = tokenized.get(index)
                if token_ids is None:
                    results.append(self.encode(index, item))
                else:
                    results.append(Document(index, self._checked(token_ids)))
            except ValueError as error:
                results.append(DocumentError(index, str(error)))
        return results


class EmbeddingInputsTask(WholeTextTask):
    """Texts to embed (pooled, or per token): an instruction `prompt` (Qwen3-Embedding's
    "Instruct: ...\nQuery:") is put before each text, as sentence-transformers does, before
    tokenizing, and a sentence-transformers checkpoint's max_seq_length cuts them."""

    def __init__(
        self,
        loaded: LoadedModel,
        pooling: PoolingConfig,
        truncate: bool = False,
        prompt: str = "",
    ) -> None:
        super().__init__(loaded, truncate)
        if hasattr(loaded.model, "classify"):
            raise ValueError(
                f"model {loaded.engine_config.model!r} ({loaded.config.architecture}) is a "
                "classifier; embed needs an embedding model or a decoder (score or classify "
                "with this one)"
            )
        if prompt and not pooling.include_prompt and pooling.strategy in ("mean", "max"):
            raise ValueError(
                "the model pools without its prompt's tokens (include_prompt false), which is "
                "not supported: embed without a prompt"
            )
        self.pooling = pooling
        self.prompt = prompt
        # A sentence-transformers checkpoint cuts its inputs at its max_seq_length (256 for
        # all-MiniLM-L6-v2): doing the same is what makes our embeddings equal to its own.
        configured_max_len = sentence_transformers_max_len(loaded.model_dir)
        if configured_max_len is not None:
            self.max_len = min(self.max_len, configured_max_len)
            self.truncate = True

    def encode_batch(self, items: Sequence[tuple[int, Any]]) -> list[Document | DocumentError]:
        if not self.prompt:
            return super().encode_batch(items)
        prompted: list[tuple[int, Any]] = []
        refused: dict[int, DocumentError] = {}
        for index, item in items:
            if isinstance(item, str):
                # An empty text stays empty: the prompt alone embeds nothing the caller wrote.
                prompted.append((index, self.prompt + item if item.strip() else item))
            else:
                refused[index] = DocumentError(index, "a prompt applies to text inputs only")
        encoded = iter(super().encode_batch(prompted))
        return [refused[index] if index in refused else next(encoded) for index, _ in items]


class EmbedTask(EmbeddingInputsTask):
    """One vector per text."""

    name = "embed"

    def process(
        self, documents: Sequence[Document], seq_lens: Sequence[int], hidden: torch.Tensor
    ) -> list[EmbeddingRequestOutput]:
        vectors = pool(hidden, seq_lens, self.pooling).cpu().tolist()
        return [
            EmbeddingRequestOutput(str(doc.index), doc.token_ids.tolist(), EmbeddingOutput(vector))
            for doc, vector in zip(documents, vectors, strict=True)
        ]


class ClassifyTask(WholeTextTask):
    name = "classify"

    def __init__(
        self, loaded: LoadedModel, truncate: bool = False, use_activation: bool = True
    ) -> None:
        super().__init__(loaded, truncate)
        self.use_activation = use_activation  # False: the logits, as vLLM's PoolingParams
        if not isinstance(loaded.model, SequenceClassifier):
            raise ValueError(
                f"model {loaded.engine_config.model!r} ({loaded.config.architecture}) has no "
                "classification head; classify needs a *ForSequenceClassification checkpoint"
            )
        id2label = getattr(loaded.config, "id2label", None) or {}
        num_labels = int(getattr(loaded.config, "num_labels", len(id2label)))
        self.labels = [str(id2label.get(i, f"LABEL_{i}")) for i in range(num_labels)]
        # As transformers' text-classification pipeline: each label its own sigmoid where one
        # label is a score (a cross-encoder) or labels are not exclusive; else a softmax.
        problem_type = getattr(loaded.hf_config, "problem_type", None)
        self.independent_labels = num_labels == 1 or problem_type == "multi_label_classification"

    def process(
        self, documents: Sequence[Document], seq_lens: Sequence[int], hidden: torch.Tensor
    ) -> list[ClassificationRequestOutput]:
        model = self.loaded.model
        assert isinstance(model, SequenceClassifier), "checked when the task was made"
        logits = model.classify(hidden, seq_lens).float()
        if not self.use_activation:
            probs = logits
        elif self.independent_labels:
            probs = torch.sigmoid(logits)
        else:
            probs = torch.softmax(logits, -1)
        results = []
        for doc, row in zip(documents, probs.cpu().tolist(), strict=True):
            best = max(range(len(row)), key=row.__getitem__)
            output = ClassificationOutput(row, self.labels[best], self.labels)
            results.append(ClassificationRequestOutput(str(doc.index), list(doc.token_ids), output))
        return results


class LoglikelihoodTask(CorpusTask):
    """Rolling log-likelihood of documents, or of continuations given contexts.

    As evaluation harnesses do it: a whole document is scored after one prefix token (BOS, or
    EOS where the tokenizer has no BOS), so every one of its tokens counts; a continuation is
    tokenized together with its context, and the context's trailing whitespace moves onto the
    continuation so that the split falls on a token boundary.
    """

    name = "loglikelihood"

    def __init__(
        self, loaded: LoadedModel, return_token_logprobs: bool = False, truncate: bool = False
    ) -> None:
        super().__init__(loaded, truncate)
        # Every model has a compute_logits (the base class raises in it): only a decoder's is
        # an LM head. A classifier or an embedding model would fail on every document.
        if not loaded.is_decoder:
            raise ValueError(
                f"model {loaded.engine_config.model!r} ({loaded.config.architecture}) has no "
                "language-model head; loglikelihood needs a causal LM"
            )
        self.return_token_logprobs = return_token_logprobs
        tokenizer = self.tokenizer
        prefix = tokenizer.bos_token_id
        if prefix is None:
            prefix = tokenizer.eos_token_id
        if prefix is None:
            raise ValueError("the tokenizer has neither a BOS nor an EOS token to score after")
        self.prefix_token_id = int(prefix)

    def encode(self, index: int, item: Any) -> Document:
        if isinstance(item, tuple):
            context, continuation = item
            if not continuation:
                raise ValueError("the continuation is empty")
            stripped = context.rstrip()
            continuation = context[len(stripped) :] + continuation
            context_ids = self.tokenizer.encode(stripped, add_special_tokens=False)
            whole = self.tokenizer.encode(stripped + continuation, add_special_tokens=False)
            continuation_ids = whole[len(context_ids) :]
            if not continuation_ids:
                raise ValueError("the continuation has no tokens")
            context_ids = context_ids or [self.prefix_token_id]
            token_ids = self._fit_continuation(context_ids, continuation_ids)
            return Document(
                index, token_ids, payload=(len(token_ids) - len(continuation_ids), True)
            )
        token_ids = [self.prefix_token_id, *self._token_ids(index, item, add_special_tokens=False)]
        return Document(index, self._fit(token_ids), payload=(1, False))

    def _fit_continuation(self, context_ids: list[int], continuation_ids: list[int]) -> list[int]:
        total = len(context_ids) + len(continuation_ids)
        if total <= self.max_len:
            return context_ids + continuation_ids
        if len(continuation_ids) >= self.max_len:
            # Only context tokens are ever dropped: truncating cannot help, so none is advised.
            raise ValueError(
                f"the continuation alone is {len(continuation_ids)} tokens, and at least one "
                f"context token must fit before it in the model's context ({self.max_len})"
            )
        if not self.truncate:
            raise ValueError(
                f"context and continuation are {total} tokens, longer than the model's context "
                f"({self.max_len}); {TRUNCATE_HINT} to drop the oldest context tokens"
            )
        return context_ids[total - self.max_len :] + continuation_ids

    def process(
        self, documents: Sequence[Document], seq_lens: Sequence[int], hidden: torch.Tensor
    ) -> list[LoglikelihoodOutput]:
        # Row r predicts token r + 1 of its document: score tokens first_scored .. len - 1.
        rows: list[int] = []
        targets: list[int] = []
        counts: list[int] = []
        offset = 0
        for doc, seq_len in zip(documents, seq_lens, strict=True):
            first_scored, _ = doc.payload
            rows.extend(range(offset + first_scored - 1, offset + seq_len - 1))
            targets.extend(doc.token_ids[first_scored:seq_len])
            counts.append(seq_len - first_scored)
            offset += seq_len
        device = hidden.device
        row_index = torch.tensor(rows, dtype=torch.int64, device=device)
        target_ids = torch.tensor(targets, dtype=torch.int64, device=device)
        is_continuation = [doc.payload[1] for doc in documents]
        scores = score_tokens(
            functools.partial(self.loaded.compute_logits, dtype=None),
            hidden,
            row_index,
            target_ids,
            any(is_continuation),
        )
        logprob_parts = scores.logprobs.split(counts)
        greedy_parts = (
            scores.is_greedy.split(counts) if scores.is_greedy is not None else [None] * len(counts)
        )
        results = []
        for doc, continuation, logprob_part, greedy_part in zip(
            documents, is_continuation, logprob_parts, greedy_parts, strict=True
        ):
            results.append(
                LoglikelihoodOutput(
                    index=doc.index,
                    logprob=float(logprob_part.double().sum()),
                    num_tokens=logprob_part.numel(),
                    is_greedy=bool(greedy_part.all()) if continuation else None,
                    token_logprobs=logprob_part.tolist() if self.return_token_logprobs else None,
                )
            )
        return results
