"""Finding a checkpoint (local directory or hub id) and streaming its weights into our model."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig

from vacpack.models.base import PackedModel, ShardedParameters
from vacpack.models.layer_ops import LayerOps, select_layer_ops, use_layer_ops
from vacpack.models.parallel import prepack_linear_weights
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


def load_model(
    model_dir: Path,
    hf_config,
    dtype: torch.dtype,
    device: torch.device,
    layer_ops: LayerOps | None = None,
) -> PackedModel:
    """Builds the model on the meta device, then streams each checkpoint tensor into place.

    Nothing is materialised twice: parameters are allocated once on the target device and each
    tensor is read from its file, cast, and copied into its (merged, sharded) slot. The layers
    run `layer_ops` (default: the preferred ops for the device and dtype).
    """
    architectures = getattr(hf_config, "architectures", None) or []
    if not architectures:
        raise ValueError(f"{str(model_dir)!r}: config.json names no architectures")
    model_class = model_class_for(architectures[0])
    config = model_class.config_class.from_hf(hf_config)
    layer_ops = layer_ops or select_layer_ops(device, dtype)
    with torch.device("meta"), use_layer_ops(layer_ops):
        model = model_class(config).to(dtype)
    model = model.to_empty(device=device)
    expected = {name for name, _ in model.named_parameters()}
    loaded: set[str] = set()
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
                tensor = checkpoint.get_tensor(hf_name).to(device=device, dtype=dtype)
                if isinstance(module, ShardedParameters):
                    module.load_shard(attr, tensor, shard_index)
                else:  # a plain torch layer, never sharded
                    getattr(module, attr).data.copy_(tensor)
                loaded.add(name)
    missing = expected - loaded
    if missing:
        raise ValueError(f"checkpoint {str(model_dir)!r} lacks weights for: {sorted(missing)[:8]}")
    model.finish_loading()
    num_packed = prepack_linear_weights(model)
    if num_packed:
        logger.info("%d linear weights prepacked for oneDNN", num_packed)
    return model.eval()
