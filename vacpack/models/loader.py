"""Finding a checkpoint (local directory or hub id) and streaming its weights into our model."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import AutoConfig

from vacpack.models.base import PackedModel, ShardedParameters
from vacpack.models.layer_ops import select_layer_ops, use_layer_ops
from vacpack.models.parallel import SINGLE_RANK, TensorParallel, prepack_linear_weights
from vacpack.models.registry import model_class_for

logger = logging.getLogger(__name__)

_CHECKPOINT_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]


class ModelNotFoundError(ValueError):
    pass


def resolve_model_path(name_or_path: str, revision: str | None = None) -> Path:
    """A local checkpoint directory as it is; a hub id downloaded (or found in the local cache)."""
    local = Path(name_or_path).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ModelNotFoundError(f"model directory {str(local)!r} has no config.json")
        return local
    if local.suffix or name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1:
        raise ModelNotFoundError(f"model {name_or_path!r}: no such local directory")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError

    try:
        return Path(
            snapshot_download(name_or_path, revision=revision, allow_patterns=_CHECKPOINT_FILES)
        )
    except (HfHubHTTPError, OSError, ValueError) as error:
        raise ModelNotFoundError(
            f"model {name_or_path!r} is not a local directory and could not be fetched from the "
            f"Hugging Face hub (offline, or no such repository): {type(error).__name__}: {error}"
        ) from error


def load_hf_config(model_dir: Path, trust_remote_code: bool = False):
    try:
        return AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except ValueError:
        # A model type transformers does not know: when we do not support its architecture
        # either, that (and what we do support) is the error to give, not a transformers upgrade.
        for architecture in _declared_architectures(model_dir):
            model_class_for(architecture)
        raise


def _declared_architectures(model_dir: Path) -> list[str]:
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    architectures = config.get("architectures") if isinstance(config, dict) else None
    return [str(a) for a in architectures] if isinstance(architectures, list) else []


def checkpoint_dtype(hf_config) -> torch.dtype | None:
    # transformers 5 names it dtype and warns on reading torch_dtype, the name 4.x used.
    fields = vars(hf_config)
    dtype = fields.get("dtype") or fields.get("torch_dtype")
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else None


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"no *.safetensors weights in {str(model_dir)!r}")
    return files


@dataclass(frozen=True)
class LoadStats:
    """What loading took on this rank: bytes read from the checkpoint files (only this rank's
    slices of sharded tensors) and bytes of parameters allocated."""

    checkpoint_bytes_read: int
    parameter_bytes: int


class _CheckpointTensor:
    """One checkpoint tensor, read lazily and only in the part a layer asks for."""

    def __init__(
        self, checkpoint: Any, name: str, dtype: torch.dtype, device: torch.device
    ) -> None:
        self._checkpoint = checkpoint
        self._name = name
        self._slice = checkpoint.get_slice(name)
        self._dtype = dtype
        self._device = device
        self.bytes_read = 0

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._slice.get_shape())

    def read(self, dim: int = 0, start: int = 0, length: int | None = None) -> torch.Tensor:
        full_length = self.shape[dim] if self.shape else 1
        length = full_length - start if length is None else length
        if start == 0 and length == full_length:
            tensor = self._checkpoint.get_tensor(self._name)
        else:
            assert start >= 0 and start + length <= full_length, (self._name, start, length)
            tensor = self._slice[(slice(None),) * dim + (slice(start, start + length),)]
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor.to(device=self._device, dtype=self._dtype)


def build_model(hf_config: Any, dtype: torch.dtype, device: torch.device, tp: TensorParallel):
    """The model for `hf_config`, on the meta device: its shapes, no memory. Raises ValueError
    where it cannot be built (or sharded over tp.size ranks)."""
    architectures = getattr(hf_config, "architectures", None) or []
    if not architectures:
        raise ValueError("config.json names no architectures")
    model_class = model_class_for(architectures[0])
    config = model_class.config_class.from_hf(hf_config)
    with torch.device("meta"), use_layer_ops(select_layer_ops(device, dtype)):
        return model_class(config, tp).to(dtype)


def load_model(model_dir: Path, hf_config, dtype: torch.dtype, device: torch.device) -> PackedModel:
    """The whole model on one device (see load_model_shard)."""
    return load_model_shard(model_dir, hf_config, dtype, device)[0]


def load_model_shard(
    model_dir: Path,
    hf_config,
    dtype: torch.dtype,
    device: torch.device,
    tp: TensorParallel = SINGLE_RANK,
) -> tuple[PackedModel, LoadStats]:
    """Builds this rank's part of the model on the meta device, then streams each checkpoint
    tensor's slice for this rank into place.

    Nothing is materialised twice: parameters are allocated once on the target device and each
    layer reads from the file only the rows or columns it keeps, casts them, and copies them
    into its (merged, sharded) slot.
    """
    model = build_model(hf_config, dtype, device, tp).to_empty(device=device)
    expected = {name for name, _ in model.named_parameters()}
    loaded: set[str] = set()
    bytes_read = 0
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as checkpoint:
            for hf_name in checkpoint.keys():  # noqa: SIM118 (safe_open is not a dict)
                target = model.checkpoint_name(hf_name)
                if target is None:
                    continue
                name, shard_index = target
                module_name, _, attr = name.rpartition(".")
                try:
                    module = model.get_submodule(module_name)
                except AttributeError:
                    logger.warning("skipping checkpoint tensor %s: no such layer", hf_name)
                    continue
                source = _CheckpointTensor(checkpoint, hf_name, dtype, device)
                if isinstance(module, ShardedParameters):
                    module.load_shard(attr, source, shard_index)
                else:  # a plain torch layer, never sharded
                    getattr(module, attr).data.copy_(source.read())
                bytes_read += source.bytes_read
                loaded.add(name)
    missing = expected - loaded
    if missing:
        raise ValueError(f"checkpoint {str(model_dir)!r} lacks weights for: {sorted(missing)[:8]}")
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model.finish_loading()
    num_packed = prepack_linear_weights(model)
    if num_packed:
        logger.info("%d linear weights prepacked for oneDNN", num_packed)
    return model.eval(), LoadStats(bytes_read, parameter_bytes)
