"""Hugging Face architecture names -> our model classes."""

from __future__ import annotations

from torch import nn

from vacpack.models.bert import BertForSequenceClassification, BertModel
from vacpack.models.decoder_embedding import LlamaModel
from vacpack.models.llama import LlamaForCausalLM
from vacpack.models.llama_classifier import LlamaForSequenceClassification
from vacpack.models.xlm_roberta import XLMRobertaForSequenceClassification, XLMRobertaModel

_ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "LlamaForSequenceClassification": LlamaForSequenceClassification,
    "MistralForSequenceClassification": LlamaForSequenceClassification,
    "Qwen2ForSequenceClassification": LlamaForSequenceClassification,
    "Qwen3ForSequenceClassification": LlamaForSequenceClassification,
    "BertModel": BertModel,
    "BertForSequenceClassification": BertForSequenceClassification,
    "XLMRobertaModel": XLMRobertaModel,
    "XLMRobertaForSequenceClassification": XLMRobertaForSequenceClassification,
    "RobertaModel": XLMRobertaModel,
    "RobertaForSequenceClassification": XLMRobertaForSequenceClassification,
    # Decoder embedding models (Qwen3-Embedding style): the body without an LM head.
    "LlamaModel": LlamaModel,
    "MistralModel": LlamaModel,
    "Qwen2Model": LlamaModel,
    "Qwen3Model": LlamaModel,
}


def model_class_for(architecture: str) -> type[nn.Module]:
    if architecture not in _ARCHITECTURES:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: {sorted(_ARCHITECTURES)}"
        )
    return _ARCHITECTURES[architecture]
