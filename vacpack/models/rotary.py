"""Rotary position embeddings (the half-split "neox" layout used by Llama, Mistral, Qwen, Gemma
and Phi-3), with the frequency scalings transformers implements.

Positions are given per token, so a packed stream of sequences simply carries positions that
restart at 0 for each sequence. cos and sin of every position are computed once into a table.

Scalings (the `rope_type` of a checkpoint's rope settings):
- linear, llama3, yarn: fixed frequencies (yarn also scales cos and sin by an attention factor).
- longrope (Phi-3): transformers switches between short and long factors per forward pass, by
  whether the pass's longest position passes original_max_position_embeddings, so a sequence
  that crosses that length mid-generation keeps keys rotated with the short factors in its
  cache. Here the factors are fixed by the longest context the engine will run (as vLLM does):
  long when max_model_len exceeds the original length. That equals transformers whenever every
  sequence stays within the original length, or a prompt is already longer than it.
- dynamic (NTK): transformers recomputes the base from the sequence length once a forward pass
  reaches past max_position_embeddings; in generation, a token at position p >= that length is
  rotated with the base for length p + 1, and earlier tokens keep theirs. The table does exactly
  that per position, so generation equals transformers whenever the prompt fits in
  max_position_embeddings, and cached keys never change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")


def rope_type_of(scaling: dict[str, Any] | None) -> str:
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))


@dataclass(frozen=True)
class RopeSettings:
    """Everything the rotary table depends on."""

    head_dim: int
    theta: float
    scaling: dict[str, Any] | None  # the checkpoint's rope settings beyond theta; None: default
    max_position_embeddings: int
    partial_rotary_factor: float = 1.0

    @property
    def rotary_dim(self) -> int:
        """Leading dimensions of each head that rotate; the rest pass through unchanged."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def rope_type(self) -> str:
        return rope_type_of(self.scaling)

    @property
    def max_context_len(self) -> int:
        """The longest context the scaling is made for (as vLLM derives it): linear and dynamic
        stretch max_position_embeddings by their factor, yarn the original length by its."""
        scaling = self.scaling or {}
        if self.rope_type in ("linear", "dynamic"):
            return int(self.max_position_embeddings * scaling["factor"])
        if self.rope_type == "yarn" and scaling.get("factor"):
            original = scaling.get("original_max_position_embeddings", self.max_position_embeddings)
            return max(self.max_position_embeddings, int(original * scaling["factor"]))
        return self.max_position_embeddings


def check_rope_type(scaling: dict[str, Any] | None) -> None:
    rope_type = rope_type_of(scaling)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope scaling type {rope_type!r} is not supported ({', '.join(SUPPORTED_ROPE_TYPES)})"
        )


def _base_exponents(rotary_dim: int) -> torch.Tensor:
    # float32 throughout, as the reference does, so that positions rotate bit-identically.
    return torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim


def rope_inverse_frequencies(
    settings: RopeSettings, context_len: int | None = None
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim // 2], attention factor applied to cos and sin) for every
    scaling but dynamic, whose frequencies depend on the position (see `_dynamic_angles`).
    context_len, the longest sequence that will run, picks longrope's factors."""
    check_rope_type(settings.scaling)
    scaling = settings.scaling or {}
    exponents = _base_exponents(settings.rotary_dim)
    inv_freq = 1.0 / (settings.theta**exponents)
    rope_type = settings.rope_type
    if rope_type in ("default", "dynamic"):
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / scaling["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_frequencies(inv_freq, scaling), 1.0
    if rope_type == "yarn":
        return _yarn_frequencies(settings, exponents)
    return _longrope_frequencies(settings, exponents, context_len)


def _llama3_frequencies(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 keeps high frequencies, divides low ones by `factor`, and blends in between."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    original_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen = original_context / low_freq_factor
    high_freq_wavelen = original_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_frequencies(
    settings: RopeSettings, exponents: torch.Tensor
) -> tuple[torch.Tensor, float]:
    """YaRN: frequencies that turn more than `beta_fast` times over the original context keep
    their value, those turning fewer than `beta_slow` times are divided by `factor`, with a
    linear ramp between; cos and sin grow by an attention factor (0.1 ln(factor) + 1)."""
    scaling = settings.scaling or {}
    dim, theta = settings.rotary_dim, settings.theta
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or settings.max_position_embeddings / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def dimension_turning(num_turns: float) -> float:
        """The dimension whose frequency turns num_turns times over the original context."""
        return dim * math.log(original / (num_turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension_turning(beta_fast), dimension_turning(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1 where the original frequency is kept (extrapolation)
    position_freqs = theta**exponents
    inv_freq = (1.0 / (factor * position_freqs)) * (1 - keep) + (1.0 / position_freqs) * keep
    return inv_freq, float(attention_factor)


def _longrope_frequencies(
    settings: RopeSettings, exponents: torch.Tensor, context_len: int | None
) -> tuple[torch.Tensor, float]:
    scaling = settings.scaling or {}
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or settings.max_position_embeddings / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    context_len = settings.max_position_embeddings if context_len is None else context_len
    factors = scaling["long_factor"] if context_len > original else scaling["short_factor"]
    ext_factors = torch.tensor(factors, dtype=torch.float32)
    return 1.0 / (ext_factors * settings.theta**exponents), float(attention_factor)


def _dynamic_angles(settings: RopeSettings, positions: torch.Tensor) -> torch.Tensor:
    """Angles [positions, rotary_dim // 2] of dynamic NTK scaling: position p at or past
    max_position_embeddings turns with the base for a sequence of p + 1 tokens, as transformers
    computes it in float32 for a forward pass whose last position is p."""
    scaling = settings.scaling or {}
    dim, max_position = settings.rotary_dim, settings.max_position_embeddings
    factor = scaling["factor"]
    seq_lens = torch.clamp(positions.to(torch.int64) + 1, min=max_position)
    stretch = (factor * seq_lens / max_position) - (factor - 1)
    bases = settings.theta * stretch ** (dim / (dim - 2))
    inv_freq = 1.0 / (bases.unsqueeze(1) ** _base_exponents(dim))
    short = positions < max_position
    inv_freq[short] = 1.0 / (settings.theta ** _base_exponents(dim))
    return positions.float().unsqueeze(1) * inv_freq


class RotaryEmbedding(nn.Module):
    def __init__(self, settings: RopeSettings) -> None:
        super().__init__()
        check_rope_type(settings.scaling)
        self.settings = settings
        self.rotary_dim = settings.rotary_dim
        self.num_positions = settings.max_context_len
        self.register_buffer("cos_sin", torch.empty(0), persistent=False)

    def build_cache(
        self, device: torch.device, dtype: torch.dtype, context_len: int | None = None
    ) -> None:
        """Precomputes cos and sin of every position up to context_len (again after leaving the
        meta device, or once the engine has chosen its context length)."""
        if context_len is not None:
            self.num_positions = context_len
        positions = torch.arange(self.num_positions, dtype=torch.float32)
        if self.settings.rope_type == "dynamic":
            angles, attention_factor = _dynamic_angles(self.settings, positions), 1.0
        else:
            inv_freq, attention_factor = rope_inverse_frequencies(self.settings, self.num_positions)
            angles = torch.outer(positions, inv_freq)
        cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)
        if attention_factor != 1.0:
            cos_sin = cos_sin * attention_factor
        # Rounded to the activation dtype, as the reference implementations do.
        self.cos_sin = cos_sin.to(device=device, dtype=dtype)

    def cos_sin_for(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for each token, [num_tokens, 1, rotary_dim // 2]: gathered once per
        forward."""
        cos, sin = self.cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_dim]; with partial rotary only the leading dimensions
    rotate."""
    cos, sin = cos_sin
    rotary_dim = 2 * cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        rotated = apply_rotary(x[..., :rotary_dim], cos_sin)
        return torch.cat([rotated, x[..., rotary_dim:]], dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
