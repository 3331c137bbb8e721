"""LLM.encode's pooling tasks, as vLLM names them: per-token embeddings (token_embed) and the
embed and classify jobs' results, each input's as one tensor."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from vacpack.corpus.packing import Document, DocumentError
from vacpack.corpus.tasks import EmbeddingInputsTask
from vacpack.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
)

POOLING_TASKS = ("token_embed", "embed", "classify", "token_classify")


def check_pooling_task(pooling_task: str | None, field: str = "pooling_task") -> str:
    """The task, or ValueError saying which ones there are (or why this one cannot run);
    `field` names where the task was given."""
    if pooling_task is None or pooling_task not in POOLING_TASKS:
        raise ValueError(f"{field} must be one of {', '.join(POOLING_TASKS)}; got {pooling_task!r}")
    if pooling_task == "token_classify":
        raise ValueError(
            "token_classify needs a per-token classification head (*ForTokenClassification), "
            "which vacpack does not load; token_embed gives each token's hidden state"
        )
    return pooling_task


def check_dimensions_apply(pooling_task: str, dimensions: int | None) -> None:
    """ValueError where `dimensions` is given for a task whose results are not embeddings."""
    if dimensions is not None and pooling_task == "classify":
        raise ValueError("dimensions applies to embeddings, not to classify")


class TokenEmbedTask(EmbeddingInputsTask):
    """One vector per token: the model's last hidden states (an encoder's token embeddings,
    as sentence-transformers' output_value="token_embeddings"), cut to the pooling's
    dimensions and normalized per token where it normalizes."""

    name = "token_embed"

    def process(
        self, documents: Sequence[Document], seq_lens: Sequence[int], hidden: torch.Tensor
    ) -> list[PoolingRequestOutput]:
        vectors = hidden.float()
        if self.pooling.dimensions is not None:
            vectors = vectors[:, : self.pooling.dimensions]
        if self.pooling.normalize:
            vectors = F.normalize(vectors, p=2.0, dim=-1)
        rows = vectors.cpu().split(list(seq_lens))
        return [
            PoolingRequestOutput(str(doc.index), doc.token_ids.tolist(), PoolingOutput(row))
            for doc, row in zip(documents, rows, strict=True)
        ]


def as_pooling_output(result: Any) -> PoolingRequestOutput | DocumentError:
    """An embed or classify job's result as encode returns it (a failure as it is)."""
    if isinstance(result, EmbeddingRequestOutput):
        data = torch.tensor(result.outputs.embedding, dtype=torch.float32)
    elif isinstance(result, ClassificationRequestOutput):
        data = torch.tensor(result.outputs.probs, dtype=torch.float32)
    else:
        return result
    return PoolingRequestOutput(result.request_id, result.prompt_token_ids, PoolingOutput(data))
