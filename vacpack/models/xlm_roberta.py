"""RoBERTa and XLM-RoBERTa encoders (bge-m3, multilingual-e5, their cross-encoder rerankers).

They are BERT with three differences, and only those live here: position ids start after the
padding row (padding_idx + 1) and skip padding tokens, the encoder sits under "roberta." in task
checkpoints, and the classification head is named classifier.dense / classifier.out_proj (the
same dense + tanh + linear on the first token as BERT's pooler and classifier). XLM-R has a
single token type, so its tokenizer returns no token_type_ids.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch

from vacpack.models.bert import BertForSequenceClassification, BertModel, EncoderConfig


@dataclasses.dataclass(frozen=True)
class RobertaEncoderConfig(EncoderConfig):
    padding_idx: int = 1

    @classmethod
    def from_hf(cls, hf_config: Any) -> RobertaEncoderConfig:
        config = super().from_hf(hf_config)
        assert isinstance(config, RobertaEncoderConfig)  # EncoderConfig.from_hf builds a cls
        padding_idx = getattr(hf_config, "pad_token_id", None)
        padding_idx = 1 if padding_idx is None else int(padding_idx)
        position_offset = padding_idx + 1
        if config.max_position_embeddings <= position_offset:
            raise ValueError(
                f"max_position_embeddings ({config.max_position_embeddings}) leaves no position "
                f"after the padding offset ({position_offset})"
            )
        # The table holds max_position_embeddings rows, the first position_offset of them
        # unused by real tokens: 514 rows read 512-token sequences.
        return dataclasses.replace(
            config,
            max_position_embeddings=config.max_position_embeddings - position_offset,
            position_offset=position_offset,
            padding_idx=padding_idx,
        )


class XLMRobertaModel(BertModel):
    """The bare encoder, for embeddings pooled outside the model."""

    config_class = RobertaEncoderConfig
    CHECKPOINT_PREFIX: ClassVar[str] = "roberta."

    def position_ids(self, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """As the reference numbers them: padding_idx + 1 + the count of non-padding tokens so
        far in the sequence, and padding_idx for a padding token.

        Sequence boundaries come from `positions` (0 at each sequence's first token), so the
        count restarts per sequence with one cumulative sum over the whole packed stream.
        """
        padding_idx = self.config.padding_idx
        is_token = token_ids != padding_idx
        counts = is_token.cumsum(0)
        starts = torch.arange(token_ids.numel(), device=token_ids.device) - positions
        counted_before = torch.where(starts > 0, counts[(starts - 1).clamp(min=0)], 0)
        return torch.where(is_token, counts - counted_before + padding_idx, padding_idx)


class XLMRobertaForSequenceClassification(XLMRobertaModel, BertForSequenceClassification):
    """A RoBERTa cross-encoder or classifier: BERT's head under RoBERTa's names."""

    HEAD_WEIGHTS: ClassVar[tuple[tuple[str, str], ...]] = (
        ("classifier.dense.", "pooler."),
        ("classifier.out_proj.", "classifier."),
    )
