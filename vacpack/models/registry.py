"""Hugging Face architecture names -> our model classes."""

from __future__ import annotations

from torch import nn

from vacpack.models.bert import BertForSequenceClassification, BertModel
from vacpack.models.gemma import GemmaForCausalLM
from vacpack.models.llama import LlamaForCausalLM
from vacpack.models.llama_classifier import LlamaForSequenceClassification
from vacpack.models.moe import MoeForCausalLM
from vacpack.models.phi3 import Phi3ForCausalLM

_ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "MixtralForCausalLM": MoeForCausalLM,
    "Qwen2MoeForCausalLM": MoeForCausalLM,
    "Qwen3MoeForCausalLM": MoeForCausalLM,
    "LlamaForSequenceClassification": LlamaForSequenceClassification,
    "MistralForSequenceClassification": LlamaForSequenceClassification,
    "Qwen2ForSequenceClassification": LlamaForSequenceClassification,
    "Qwen3ForSequenceClassification": LlamaForSequenceClassification,
    "BertModel": BertModel,
    "BertForSequenceClassification": BertForSequenceClassification,
}


def model_class_for(architecture: str) -> type[nn.Module]:
    if architecture not in _ARCHITECTURES:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: {sorted(_ARCHITECTURES)}"
        )
    return _ARCHITECTURES[architecture]
