"""The model facts the engine needs, read once from a Hugging Face config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    hidden_act: str

    @classmethod
    def from_hf(cls, hf_config: Any) -> ModelConfig:
        architectures = getattr(hf_config, "architectures", None) or []
        if not architectures:
            raise ValueError("config.json names no architectures; cannot pick a model class")
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        model_type = getattr(hf_config, "model_type", "")
        rope_theta, rope_scaling = _rope(hf_config)
        return cls(
            architecture=architectures[0],
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            intermediate_size=hf_config.intermediate_size,
            rms_norm_eps=hf_config.rms_norm_eps,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=hf_config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; Llama-style configs say so with attention_bias.
            attention_bias=model_type == "qwen2"
            or bool(getattr(hf_config, "attention_bias", False)),
            qk_norm=model_type == "qwen3",
            hidden_act=getattr(hf_config, "hidden_act", "silu"),
        )


def _rope(hf_config: Any) -> tuple[float, dict[str, Any] | None]:
    """transformers 5 keeps rope settings in `rope_parameters`; older configs in two fields."""
    parameters = getattr(hf_config, "rope_parameters", None)
    if isinstance(parameters, dict) and "rope_theta" in parameters:
        scaling = dict(parameters)
        theta = float(scaling.pop("rope_theta"))
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        return theta, None if rope_type == "default" else scaling
    theta = float(getattr(hf_config, "rope_theta", 10000.0))
    return theta, getattr(hf_config, "rope_scaling", None)
