"""Gemma 2 and Gemma 3 (text) decoders: Llama's attention and MLP with Gemma's differences.

- RMSNorm scales by (1 + weight), in float32 before rounding, and every block has four norms:
  before and after attention, before and after the MLP (the "sandwich").
- Token embeddings are multiplied by sqrt(hidden_size), rounded to the model's dtype first.
- Attention scores are scaled by query_pre_attn_scalar ** -0.5, not head_dim ** -0.5; Gemma 2
  soft-caps them (cap * tanh(score / cap)) and soft-caps the final logits too.
- Layers alternate between sliding-window and global attention (config.layer_types).
- Gemma 3 normalises q and k per head and gives its sliding layers their own rope base.
- The MLP is gated GELU (tanh approximation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from vacpack.attention.backend import AttentionSpec
from vacpack.models.forward_context import ForwardContext
from vacpack.models.llama import (
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    select_rows,
    with_kept_rows,
)
from vacpack.models.model_config import ModelConfig, decoder_fields, split_rope_parameters
from vacpack.models.norm import RMSNorm
from vacpack.models.parallel import SINGLE_RANK, TensorParallel
from vacpack.models.rotary import RopeSettings, RotaryEmbedding, check_rope_type


class GemmaRMSNorm(RMSNorm):
    """Scales by (1 + weight) in float32, before rounding: never the fused kernels."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_float = x.float()
        x_float = x_float * torch.rsqrt(x_float.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x_float * (1.0 + self.weight.float())).to(x.dtype)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = x + residual
        return self(residual), residual


@dataclass(frozen=True)
class GemmaConfig(ModelConfig):
    query_pre_attn_scalar: float
    attn_logit_softcap: float | None
    final_logit_softcap: float | None
    # Gemma 3's sliding-window layers rotate with their own base (and scaling); None: the same
    # rotation as the global layers (Gemma 2).
    local_rope_theta: float | None
    local_rope_scaling: dict[str, Any] | None

    @classmethod
    def from_hf(cls, hf_config: Any) -> GemmaConfig:
        if getattr(hf_config, "use_bidirectional_attention", False):
            raise ValueError(
                "Gemma with use_bidirectional_attention (an embedding model) is not supported"
            )
        fields = decoder_fields(hf_config)
        local_theta = local_scaling = None
        parameters = getattr(hf_config, "rope_parameters", None) or {}
        if "full_attention" in parameters:  # transformers 5 keeps Gemma 3's per kind of layer
            theta, scaling, _ = split_rope_parameters(parameters["full_attention"])
            local_theta, local_scaling, _ = split_rope_parameters(parameters["sliding_attention"])
            fields.update(rope_theta=theta, rope_scaling=scaling)
        elif getattr(hf_config, "rope_local_base_freq", None) is not None:
            local_theta = float(hf_config.rope_local_base_freq)  # transformers 4's Gemma 3
        check_rope_type(fields["rope_scaling"])
        check_rope_type(local_scaling)
        return cls(
            **fields,
            query_pre_attn_scalar=float(hf_config.query_pre_attn_scalar),
            attn_logit_softcap=getattr(hf_config, "attn_logit_softcapping", None),
            final_logit_softcap=getattr(hf_config, "final_logit_softcapping", None),
            local_rope_theta=local_theta,
            local_rope_scaling=local_scaling,
        )

    def attention_spec(self, layer_index: int) -> AttentionSpec:
        return AttentionSpec(
            sliding_window=self.sliding_windows[layer_index],
            scale=self.query_pre_attn_scalar**-0.5,
            logit_softcap=self.attn_logit_softcap,
        )

    @property
    def local_rope(self) -> RopeSettings | None:
        if self.local_rope_theta is None:
            return None
        return RopeSettings(
            self.head_dim,
            self.local_rope_theta,
            self.local_rope_scaling,
            self.max_position_embeddings,
            self.partial_rotary_factor,
        )


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: GemmaConfig, layer_index: int, tp: TensorParallel) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.self_attn = LlamaAttention(config, layer_index, tp, norm_class=GemmaRMSNorm)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.mlp = LlamaMLP(config, tp)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.is_sliding = config.sliding_windows[layer_index] is not None

    def forward(
        self,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: ForwardContext,
        keep_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As Llama's layer, the residual add is left to the next norm: this returns
        (post_feedforward_norm(mlp), residual) and the caller adds them. keep_rows as
        Llama's."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden, residual = select_rows(keep_rows, self.self_attn(cos_sin, hidden, ctx), residual)
        hidden = self.post_attention_layernorm(hidden)
        hidden, residual = self.pre_feedforward_layernorm.add_and_norm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class GemmaForCausalLM(LlamaForCausalLM):
    config_class = GemmaConfig
    norm_class: ClassVar[type[RMSNorm]] = GemmaRMSNorm

    def __init__(self, config: GemmaConfig, tp: TensorParallel = SINGLE_RANK) -> None:
        super().__init__(config, tp)
        local = config.local_rope
        self.local_rotary = RotaryEmbedding(local) if local is not None else None
        # sqrt(hidden_size) rounded to the model's dtype, as the reference multiplies by it.
        self.embed_scale = config.hidden_size**0.5

    def make_layer(self, config: ModelConfig, layer_index: int, tp: TensorParallel) -> nn.Module:
        assert isinstance(config, GemmaConfig)
        return GemmaDecoderLayer(config, layer_index, tp)

    def rotary_embeddings(self) -> list[RotaryEmbedding]:
        return [self.rotary] + ([self.local_rotary] if self.local_rotary is not None else [])

    def finish_loading(self) -> None:
        super().finish_loading()
        dtype = self.embed_tokens.dtype
        self.embed_scale = float(torch.tensor(self.config.hidden_size**0.5, dtype=dtype))

    def forward(
        self, token_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        global_cos_sin = self.rotary.cos_sin_for(positions)
        local_cos_sin = global_cos_sin
        if self.local_rotary is not None:
            local_cos_sin = self.local_rotary.cos_sin_for(positions)
        hidden = self.embed_tokens(token_ids) * self.embed_scale
        residual = None
        for layer, keep_rows in with_kept_rows(self.layers, ctx):
            cos_sin = local_cos_sin if layer.is_sliding else global_cos_sin
            hidden, residual = layer(cos_sin, hidden, residual, ctx, keep_rows)
        assert residual is not None, "a model has at least one layer"
        hidden, _ = self.norm.add_and_norm(hidden, residual)
        return hidden

    def compute_logits(
        self, hidden: torch.Tensor, dtype: torch.dtype | None = torch.float32
    ) -> torch.Tensor:
        logits = self.lm_head.project(hidden)
        cap = self.config.final_logit_softcap
        if cap is not None:
            # In the model's dtype, as the reference caps them.
            logits = torch.tanh(logits / cap) * cap
        return logits if dtype is None else logits.to(dtype)
