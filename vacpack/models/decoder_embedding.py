"""Llama-family decoder bodies without an LM head: decoder embedding models.

Qwen3-Embedding-style checkpoints, as sentence-transformers saves them, hold the bare decoder
(architectures Qwen3Model, Qwen2Model, LlamaModel, MistralModel; tensor names without "model.")
and pool the last token of each text. Attention stays causal, so the last token is the only one
that has seen the whole text. A checkpoint that still ships an lm_head has it skipped.
"""

from __future__ import annotations

import torch

from vacpack.models.llama import LlamaForCausalLM
from vacpack.models.model_config import ModelConfig
from vacpack.models.parallel import SINGLE_RANK, TensorParallel


class LlamaModel(LlamaForCausalLM):
    # It cannot generate; it runs over packed texts with causal attention.
    is_decoder = False
    is_causal = True

    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE_RANK) -> None:
        super().__init__(config, tp)
        # Built on the meta device, so the dropped head never held memory.
        del self.lm_head

    def checkpoint_name(self, hf_name: str) -> tuple[str, int] | None:
        if hf_name.removeprefix("model.").startswith("lm_head."):
            return None
        return super().checkpoint_name(hf_name)

    def compute_logits(
        self, hidden: torch.Tensor, dtype: torch.dtype | None = torch.float32
    ) -> torch.Tensor:
        raise TypeError(f"{self.config.architecture} has no LM head; it embeds (use embed())")
