"""Hugging Face architecture names -> our model classes, imported when a checkpoint needs one."""

from __future__ import annotations

from vacpack.models.base import PackedModel
from vacpack.registry import LazyRegistry

_LLAMA = "vacpack.models.llama:LlamaForCausalLM"
_LLAMA_CLASSIFIER = "vacpack.models.llama_classifier:LlamaForSequenceClassification"
_GEMMA = "vacpack.models.gemma:GemmaForCausalLM"
_MOE = "vacpack.models.moe:MoeForCausalLM"
_DECODER_BODY = "vacpack.models.decoder_embedding:LlamaModel"
_XLM_ROBERTA = "vacpack.models.xlm_roberta:XLMRobertaModel"
_XLM_ROBERTA_CLASSIFIER = "vacpack.models.xlm_roberta:XLMRobertaForSequenceClassification"

ARCHITECTURES: LazyRegistry[type[PackedModel]] = LazyRegistry(
    "architecture",
    {
        "LlamaForCausalLM": _LLAMA,
        "MistralForCausalLM": _LLAMA,
        "Qwen2ForCausalLM": _LLAMA,
        "Qwen3ForCausalLM": _LLAMA,
        "Gemma2ForCausalLM": _GEMMA,
        "Gemma3ForCausalLM": _GEMMA,
        "Phi3ForCausalLM": "vacpack.models.phi3:Phi3ForCausalLM",
        "MixtralForCausalLM": _MOE,
        "Qwen2MoeForCausalLM": _MOE,
        "Qwen3MoeForCausalLM": _MOE,
        "LlamaForSequenceClassification": _LLAMA_CLASSIFIER,
        "MistralForSequenceClassification": _LLAMA_CLASSIFIER,
        "Qwen2ForSequenceClassification": _LLAMA_CLASSIFIER,
        "Qwen3ForSequenceClassification": _LLAMA_CLASSIFIER,
        "BertModel": "vacpack.models.bert:BertModel",
        "BertForSequenceClassification": "vacpack.models.bert:BertForSequenceClassification",
        "XLMRobertaModel": _XLM_ROBERTA,
        "XLMRobertaForSequenceClassification": _XLM_ROBERTA_CLASSIFIER,
        "RobertaModel": _XLM_ROBERTA,
        "RobertaForSequenceClassification": _XLM_ROBERTA_CLASSIFIER,
        # Decoder embedding models (Qwen3-Embedding style): the body without an LM head.
        "LlamaModel": _DECODER_BODY,
        "MistralModel": _DECODER_BODY,
        "Qwen2Model": _DECODER_BODY,
        "Qwen3Model": _DECODER_BODY,
    },
)


# A causal LM saved without its LM head (untied, no lm_head tensor), as embedding models built on
# a decoder often are (gte-Qwen2 style): the body alone, which embeds.
DECODER_BODIES = {
    "LlamaForCausalLM": "LlamaModel",
    "MistralForCausalLM": "MistralModel",
    "Qwen2ForCausalLM": "Qwen2Model",
    "Qwen3ForCausalLM": "Qwen3Model",
}


def model_class_for(architecture: str) -> type[PackedModel]:
    """The class for a checkpoint's architecture; a ValueError lists the supported ones."""
    return ARCHITECTURES.get(architecture)
