"""A checkpoint loaded for inference: model, tokenizer, device and dtype, resolved once.

The generation engine and corpus jobs both start from a LoadedModel, so an LLM that only
embeds or scores never allocates a KV cache for generation, and one that does both loads its
weights once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from vacpack.attention import AttentionShapes
from vacpack.config import EngineConfig
from vacpack.device import configure_threads, resolve_device, resolve_dtype
from vacpack.host_memory import keep_freed_host_memory
from vacpack.models.base import PackedModel
from vacpack.models.cpu_dtype import choose_cpu_dtype, timed_linear_shape
from vacpack.models.forward_context import attention_specs
from vacpack.models.hub import resolve_model_path
from vacpack.models.layer_ops_choice import LayerShapes, choose_layer_ops
from vacpack.models.loader import checkpoint_dtype, load_hf_config, load_model
from vacpack.tokenizer import eos_token_ids, load_tokenizer
from vacpack.tuning import MeasuredChoice


@dataclass(frozen=True)
class LoadedModel:
    engine_config: EngineConfig
    model_dir: Path
    hf_config: PretrainedConfig
    model: PackedModel  # model.config is its family's config (a ModelConfig for decoders)
    tokenizer: PreTrainedTokenizerBase
    eos_token_ids: frozenset[int]
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    # What was chosen by measurement at load (the dtype for dtype="auto" on a CPU, the layers'
    # elementwise ops), with the timings that chose it: for job reports and /metrics.
    measured_choices: tuple[MeasuredChoice, ...] = ()

    @property
    def config(self) -> Any:  # the family's own config class: ModelConfig, EncoderConfig, ...
        return self.model.config

    @property
    def attention_shapes(self) -> AttentionShapes:
        """What attention backends are timed at for this model (attention/selection.py)."""
        config = self.config
        return AttentionShapes(
            num_heads=config.num_heads,
            num_kv_heads=getattr(config, "num_kv_heads", config.num_heads),
            head_dim=config.head_dim,
            dtype=self.dtype,
            specs=attention_specs(self.model),
            max_model_len=self.max_model_len,
        )

    @property
    def is_decoder(self) -> bool:
        return bool(getattr(self.model, "is_decoder", False))


def load(config: EngineConfig) -> LoadedModel:
    device = resolve_device(config.device)
    configure_threads(device, config.num_threads)
    if device.type == "cpu":
        keep_freed_host_memory()
    model_dir = resolve_model_path(config.model, config.revision)
    hf_config = load_hf_config(model_dir, config.trust_remote_code)
    dtype_choice = _measured_cpu_dtype(config, hf_config, device)
    dtype = resolve_dtype(config.dtype, checkpoint_dtype(hf_config), device, dtype_choice)
    tokenizer = load_tokenizer(
        config.tokenizer or str(model_dir),
        trust_remote_code=config.trust_remote_code,
        revision=config.revision,
    )
    layer_ops, layer_ops_choices = choose_layer_ops(
        device, LayerShapes.from_hf(hf_config, dtype), dtype
    )
    model = load_model(model_dir, hf_config, dtype, device, layer_ops)
    # A RoPE scaling may stretch a decoder's context past max_position_embeddings.
    model_limit = getattr(model.config, "max_context_len", model.config.max_position_embeddings)
    max_model_len = _max_model_len(config, model_limit)
    model.limit_context(max_model_len)
    return LoadedModel(
        engine_config=config,
        model_dir=model_dir,
        hf_config=hf_config,
        model=model,
        tokenizer=tokenizer,
        eos_token_ids=eos_token_ids(tokenizer, model_dir),
        device=device,
        dtype=dtype,
        max_model_len=max_model_len,
        measured_choices=(*([dtype_choice] if dtype_choice else []), *layer_ops_choices),
    )


def _measured_cpu_dtype(
    config: EngineConfig, hf_config: Any, device: torch.device
) -> MeasuredChoice | None:
    """bfloat16 or float32, timed at the model's shapes, where dtype is auto on a CPU."""
    if config.dtype != "auto" or device.type != "cpu":
        return None
    shape = timed_linear_shape(hf_config)
    return choose_cpu_dtype(shape) if shape is not None else None


def _max_model_len(config: EngineConfig, model_limit: int) -> int:
    requested = config.max_model_len
    if requested is not None and requested > model_limit:
        raise ValueError(
            f"max_model_len={requested} exceeds the model's context of {model_limit} tokens "
            "(max_position_embeddings, stretched by its RoPE scaling)"
        )
    return requested or model_limit
