"""The model facts the engine needs, read once from a Hugging Face config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vacpack.attention.backend import AttentionSpec
from vacpack.models.rotary import RopeSettings, check_rope_type

# Families whose heads normalise q and k (RMSNorm over head_dim) before the rotation.
QK_NORM_MODEL_TYPES = frozenset({"qwen3", "qwen3_moe", "gemma3_text"})


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
    # One per layer: the layer's sliding window in tokens, None for full attention.
    sliding_windows: tuple[int | None, ...]
    partial_rotary_factor: float

    @classmethod
    def from_hf(cls, hf_config: Any) -> ModelConfig:
        return cls(**decoder_fields(hf_config))

    @property
    def rope(self) -> RopeSettings:
        return RopeSettings(
            self.head_dim,
            self.rope_theta,
            self.rope_scaling,
            self.max_position_embeddings,
            self.partial_rotary_factor,
        )

    @property
    def max_context_len(self) -> int:
        """The longest context the model is made for: max_position_embeddings, stretched by a
        RoPE scaling that extends it (linear, dynamic, yarn)."""
        return self.rope.max_context_len

    def attention_spec(self, layer_index: int) -> AttentionSpec:
        return AttentionSpec(sliding_window=self.sliding_windows[layer_index])

    @property
    def attention_specs(self) -> tuple[AttentionSpec, ...]:
        return tuple(self.attention_spec(i) for i in range(self.num_layers))

    @property
    def attention_windows(self) -> tuple[int | None, ...]:
        """The distinct windows of the layers (None: full attention), full attention first."""
        distinct = set(self.sliding_windows)
        return tuple(sorted(distinct, key=lambda w: -1 if w is None else w))

    @property
    def kv_window(self) -> int | None:
        """How many of a sequence's newest tokens any layer still reads: the largest window when
        every layer has one (older KV pages may then be freed), else None."""
        if None in self.sliding_windows:
            return None
        return max(self.sliding_windows)  # type: ignore[type-var]


def decoder_fields(hf_config: Any) -> dict[str, Any]:
    """ModelConfig's fields from a Hugging Face decoder config (family configs extend them)."""
    architectures = getattr(hf_config, "architectures", None) or []
    if not architectures:
        raise ValueError("config.json names no architectures; cannot pick a model class")
    num_heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    model_type = getattr(hf_config, "model_type", "")
    rope_theta, rope_scaling, partial_rotary_factor = rope_settings(hf_config)
    check_rope_type(rope_scaling)
    return {
        "architecture": architectures[0],
        "vocab_size": hf_config.vocab_size,
        "hidden_size": hf_config.hidden_size,
        "num_layers": hf_config.num_hidden_layers,
        "num_heads": num_heads,
        "num_kv_heads": getattr(hf_config, "num_key_value_heads", None) or num_heads,
        "head_dim": head_dim,
        "intermediate_size": hf_config.intermediate_size,
        "rms_norm_eps": hf_config.rms_norm_eps,
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": hf_config.max_position_embeddings,
        "tie_word_embeddings": bool(getattr(hf_config, "tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases, Qwen2-MoE says so with qkv_bias; Llama-style configs
        # with attention_bias.
        "attention_bias": model_type == "qwen2"
        or bool(getattr(hf_config, "qkv_bias", False))
        or bool(getattr(hf_config, "attention_bias", False)),
        "qk_norm": model_type in QK_NORM_MODEL_TYPES,
        # Gemma names it hidden_activation.
        "hidden_act": getattr(hf_config, "hidden_activation", None)
        or getattr(hf_config, "hidden_act", "silu"),
        "sliding_windows": layer_sliding_windows(hf_config),
        "partial_rotary_factor": partial_rotary_factor,
    }


def layer_sliding_windows(hf_config: Any) -> tuple[int | None, ...]:
    """Each layer's sliding window. transformers 5 configs list `layer_types` (Gemma's
    alternation, Qwen2's max_window_layers); without them a window applies to every layer
    (Mistral, Mixtral, Phi-3, Qwen3-MoE), or to the layers transformers 4 chose by rule."""
    num_layers = hf_config.num_hidden_layers
    # Qwen2-style configs keep a window size beside use_sliding_window false (transformers 4
    # leaves it set; Qwen2-MoE writes 0 for none).
    window = getattr(hf_config, "sliding_window", None) or None
    if getattr(hf_config, "use_sliding_window", True) is False or window is None:
        return (None,) * num_layers
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types:
        return tuple(window if kind == "sliding_attention" else None for kind in layer_types)
    return tuple(int(window) if _slides_in_transformers_4(hf_config, i) else None
                 for i in range(num_layers))  # fmt: skip


def _slides_in_transformers_4(hf_config: Any, layer_index: int) -> bool:
    if getattr(hf_config, "model_type", "") == "gemma2":
        return layer_index % 2 == 0
    pattern = getattr(hf_config, "sliding_window_pattern", None)  # Gemma 3
    if pattern:
        return (layer_index + 1) % pattern != 0
    first_windowed = getattr(hf_config, "max_window_layers", None)  # Qwen2
    return first_windowed is None or layer_index >= first_windowed


def rope_settings(hf_config: Any) -> tuple[float, dict[str, Any] | None, float]:
    """(theta, scaling or None for the default, partial rotary factor). transformers 5 keeps
    rope settings in `rope_parameters`; older configs in separate fields."""
    parameters = getattr(hf_config, "rope_parameters", None)
    partial = getattr(hf_config, "partial_rotary_factor", None)
    if isinstance(parameters, dict) and "rope_theta" in parameters:
        theta, scaling, nested_partial = split_rope_parameters(parameters)
        return theta, scaling, nested_partial or partial or 1.0
    theta = float(getattr(hf_config, "rope_theta", 10000.0))
    scaling = getattr(hf_config, "rope_scaling", None)
    original = getattr(hf_config, "original_max_position_embeddings", None)
    if scaling and original and "original_max_position_embeddings" not in scaling:
        scaling = {**scaling, "original_max_position_embeddings": original}  # Phi-3 keeps it apart
    return theta, scaling, partial or 1.0


def split_rope_parameters(
    parameters: dict[str, Any],
) -> tuple[float, dict[str, Any] | None, float | None]:
    """One transformers-5 rope_parameters dict -> (theta, scaling or None, partial factor)."""
    scaling = dict(parameters)
    theta = float(scaling.pop("rope_theta"))
    partial = scaling.pop("partial_rotary_factor", None)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    return theta, None if rope_type == "default" else scaling, partial
