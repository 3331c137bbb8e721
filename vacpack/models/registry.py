"""Hugging Face architecture names -> our model classes, imported when a checkpoint needs one."""

from __future__ import annotations

from vacpack.models.base import PackedModel
from vacpack.registry import LazyRegistry

_LLAMA = "vacpack.models.llama:LlamaForCausalLM"
_LLAMA_CLASSIFIER = "vacpack.models.llama_classifier:LlamaForSequenceClassification"

ARCHITECTURES: LazyRegistry[type[PackedModel]] = LazyRegistry(
    "architecture",
    {
        "LlamaForCausalLM": _LLAMA,
        "MistralForCausalLM": _LLAMA,
        "Qwen2ForCausalLM": _LLAMA,
        "Qwen3ForCausalLM": _LLAMA,
        "LlamaForSequenceClassification": _LLAMA_CLASSIFIER,
        "MistralForSequenceClassification": _LLAMA_CLASSIFIER,
        "Qwen2ForSequenceClassification": _LLAMA_CLASSIFIER,
        "Qwen3ForSequenceClassification": _LLAMA_CLASSIFIER,
        "BertModel": "vacpack.models.bert:BertModel",
        "BertForSequenceClassification": "vacpack.models.bert:BertForSequenceClassification",
    },
)


def model_class_for(architecture: str) -> type[PackedModel]:
    """The class for a checkpoint's architecture; a ValueError lists the supported ones."""
    return ARCHITECTURES.get(architecture)
