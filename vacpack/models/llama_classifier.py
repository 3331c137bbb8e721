"""Llama-family decoders as sequence classifiers (Llama, Mistral, Qwen2, Qwen3).

The body is LlamaForCausalLM's, unchanged; the LM head is replaced by a `score` linear layer
[num_labels, hidden] without bias. Attention stays causal, so a sequence's last token is the only
one that has seen all of it, and its logits are the sequence's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from vacpack.models.labels import id2label_from_hf, num_labels_from_hf
from vacpack.models.llama import LlamaForCausalLM
from vacpack.models.model_config import ModelConfig
from vacpack.models.parallel import SINGLE_RANK, TensorParallel
from vacpack.models.pooling import PoolingConfig, pool


@dataclass(frozen=True)
class DecoderClassifierConfig(ModelConfig):
    num_labels: int
    id2label: dict[int, str]

    @classmethod
    def from_hf(cls, hf_config: Any) -> DecoderClassifierConfig:
        body = ModelConfig.from_hf(hf_config)
        num_labels = num_labels_from_hf(hf_config)
        return cls(
            **{field.name: getattr(body, field.name) for field in fields(body)},
            num_labels=num_labels,
            id2label=id2label_from_hf(hf_config, num_labels),
        )


_LAST_TOKEN = PoolingConfig("last", normalize=False)


class LlamaForSequenceClassification(LlamaForCausalLM):
    config_class = DecoderClassifierConfig
    # Without an LM head it cannot generate; it runs over packed prompts with causal attention.
    is_decoder = False
    is_causal = True

    def __init__(self, config: DecoderClassifierConfig, tp: TensorParallel = SINGLE_RANK) -> None:
        super().__init__(config, tp)
        # The checkpoint has a score head instead of the LM head. The model is built on the meta
        # device, so the dropped head never held memory.
        del self.lm_head
        # Replicated on every rank: num_labels is tiny and need not divide the tp size.
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)
        self.score.requires_grad_(False)

    def compute_logits(
        self, hidden: torch.Tensor, dtype: torch.dtype | None = torch.float32
    ) -> torch.Tensor:
        raise TypeError(f"{self.config.architecture} has no LM head; use classify()")

    def classify(self, hidden: torch.Tensor, seq_lens: Sequence[int]) -> torch.Tensor:
        """[num_tokens, hidden] from forward -> float32 logits [num_seqs, num_labels]."""
        last_rows = pool(hidden, seq_lens, _LAST_TOKEN).to(hidden.dtype)
        return self.score(last_rows).float()
