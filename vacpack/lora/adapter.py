"""A PEFT LoRA checkpoint read into the model's own linear layers.

PEFT names each delta by the Hugging Face module it adapts (`...layers.0.self_attn.q_proj`
with `lora_A` [rank, in] and `lora_B` [out, rank]). The model maps that name as it maps the
base checkpoint's (`checkpoint_name`): q_proj becomes part 0 of the merged qkv_proj. Each of
our layers gets one (A, B) pair: the parts' A matrices stacked, B block-diagonal with this
layer's rows of each part, scaled by lora_alpha / rank (rsLoRA: / sqrt(rank)).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from vacpack.models.base import PackedModel
from vacpack.models.hub import resolve_model_path
from vacpack.models.parallel import ALL_SHARDS, ColumnParallelLinear, RowParallelLinear

# PEFT's prefix before the base model's own names.
_PEFT_PREFIX = "base_model.model."
# adapter_config.json settings that would change the arithmetic and are not implemented.
_UNSUPPORTED_SETTINGS = {
    "use_dora": "DoRA",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "modules_to_save": "fully trained modules (modules_to_save)",
}


@dataclass(frozen=True)
class _Delta:
    """One PEFT module's A and B, aimed at a part of one of our layers."""

    module: str  # our layer's name, e.g. "layers.0.self_attn.qkv_proj"
    shard_index: int
    a: torch.Tensor
    b: torch.Tensor


def read_adapter(
    path: str, model: PackedModel, max_rank: int, device: torch.device
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each adapted layer's (A, B), by our layer name, on `device` in float32. Raises
    ValueError naming what does not fit the model or is not supported."""
    adapter_dir = resolve_model_path(path, required_file="adapter_config.json")
    settings = _read_settings(adapter_dir)
    tensors = _read_tensors(adapter_dir)
    deltas = _deltas(tensors, model, settings, max_rank)
    by_layer: dict[str, list[_Delta]] = {}
    for delta in deltas:
        by_layer.setdefault(delta.module, []).append(delta)
    return {
        name: _merge(model.get_submodule(name), parts, device) for name, parts in by_layer.items()
    }


def _read_settings(adapter_dir: Path) -> dict[str, Any]:
    settings = json.loads((adapter_dir / "adapter_config.json").read_text(encoding="utf-8"))
    if settings.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{adapter_dir}: a {settings['peft_type']} adapter, not LoRA")
    for key, what in _UNSUPPORTED_SETTINGS.items():
        if settings.get(key):
            raise ValueError(f"{adapter_dir}: {what} is not supported")
    if settings.get("bias", "none") != "none":
        raise ValueError(
            f"{adapter_dir}: trained biases (bias={settings['bias']!r}) are not supported"
        )
    return settings


def _read_tensors(adapter_dir: Path) -> dict[str, torch.Tensor]:
    safetensors = adapter_dir / "adapter_model.safetensors"
    if safetensors.is_file():
        return load_file(str(safetensors))
    pickled = adapter_dir / "adapter_model.bin"
    if pickled.is_file():
        return torch.load(pickled, map_location="cpu", weights_only=True)
    raise ValueError(f"{adapter_dir}: no adapter_model.safetensors (or .bin)")


def _deltas(
    tensors: dict[str, torch.Tensor],
    model: PackedModel,
    settings: dict[str, Any],
    max_rank: int,
) -> list[_Delta]:
    deltas = []
    for name, a in tensors.items():
        if ".lora_A." not in name:
            if ".lora_B." not in name:
                raise ValueError(
                    f"adapter tensor {name!r} is not a LoRA A or B matrix: adapters that "
                    "save whole layers (modules_to_save, embedding layers) are not supported"
                )
            continue
        b_name = name.replace(".lora_A.", ".lora_B.")
        if b_name not in tensors:
            raise ValueError(f"adapter tensor {name!r} has no {b_name!r}")
        b = tensors[b_name]
        rank = a.shape[0]
        if rank > max_rank:
            raise ValueError(f"adapter rank {rank} exceeds max_lora_rank ({max_rank})")
        base_name = name.removeprefix(_PEFT_PREFIX).replace(".lora_A.weight", ".weight")
        target = model.checkpoint_name(base_name)
        if target is None or not target[0].endswith(".weight"):
            raise ValueError(f"adapter module {base_name!r} is not a layer of this model")
        module_name = target[0].removesuffix(".weight")
        try:
            module = model.get_submodule(module_name)
        except AttributeError:
            raise ValueError(f"adapter module {base_name!r} is not a layer of this model") from None
        # A mixture's experts each see only the rows routed to them.
        if ".experts." in module_name or not isinstance(
            module, ColumnParallelLinear | RowParallelLinear
        ):
            raise ValueError(
                f"LoRA on {base_name!r} is not supported: adapters may change the attention "
                "and dense MLP projections (q/k/v/o, gate/up/down)"
            )
        expected_b = module.checkpoint_shape("weight", target[1])[0]
        in_features = module.checkpoint_shape("weight", target[1])[1]
        if a.shape[1] != in_features or tuple(b.shape) != (expected_b, rank):
            raise ValueError(
                f"adapter module {base_name!r} has A {tuple(a.shape)} and B {tuple(b.shape)}, "
                f"not the model's [rank, {in_features}] and [{expected_b}, rank]"
            )
        alpha = settings.get("lora_alpha", rank)
        scale = alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank
        deltas.append(_Delta(module_name, target[1], a.float(), b.float() * scale))
    if not deltas:
        raise ValueError("the adapter holds no LoRA matrices")
    return deltas


def _merge(
    layer: torch.nn.Module, parts: list[_Delta], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """One (A, B) for the layer: its parts' A stacked, B holding each part's rows of this
    layer in that part's columns."""
    a = torch.cat([part.a for part in parts])
    if isinstance(layer, RowParallelLinear):
        # This rank's input columns (all of them with one rank); the partial products it adds
        # are summed by the layer's all-reduce with the others'.
        (part,) = parts
        columns = layer.columns
        return a[:, columns.start : columns.start + columns.length].to(device), part.b.to(device)
    assert isinstance(layer, ColumnParallelLinear)
    b = torch.zeros(layer.weight.shape[0], a.shape[0])
    column = 0
    for part in parts:
        rank = part.a.shape[0]
        indices = (
            range(len(layer.row_ranges)) if part.shard_index == ALL_SHARDS else [part.shard_index]
        )
        source_offset = 0
        for index in indices:
            rows = layer.row_ranges[index]
            local_offset = sum(r.length for r in layer.row_ranges[:index])
            b[local_offset : local_offset + rows.length, column : column + rank] = part.b[
                source_offset + rows.start : source_offset + rows.start + rows.length
            ]
            source_offset += rows.full_size
        column += rank
    return a.to(device), b.to(device)
