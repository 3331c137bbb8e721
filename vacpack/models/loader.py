"""Reading a checkpoint's config and streaming its weights into our model."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig

from vacpack.errors import (
    CorruptWeightsError,
    InvalidConfigError,
    ModelNotFoundError,
    WeightsMismatchError,
)
from vacpack.models.base import PackedModel, ShardedParameters
from vacpack.models.layer_ops import LayerOps, select_layer_ops, use_layer_ops
from vacpack.models.parallel import prepack_linear_weights
from vacpack.models.registry import model_class_for

logger = logging.getLogger(__name__)


def load_hf_config(model_dir: Path, trust_remote_code: bool = False):
    from huggingface_hub.errors import StrictDataclassError

    config_path = str(model_dir / "config.json")
    try:
        return AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except ValueError as error:
        # A model type transformers does not know: when we do not support its architecture
        # either, that (and what we do support) is the error to give, not a transformers upgrade.
        for architecture in _declared_architectures(model_dir):
            try:
                model_class_for(architecture)
            except ValueError as unsupported:
                raise InvalidConfigError(f"{config_path!r}: {unsupported}") from error
        raise InvalidConfigError(f"invalid {config_path!r}: {error}") from error
    except (OSError, KeyError, TypeError, StrictDataclassError) as error:
        raise InvalidConfigError(f"invalid {config_path!r}: {error}") from error


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
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = [model_dir / name for name in sorted(set(weight_map.values()))]
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise CorruptWeightsError(f"invalid weights index {str(index)!r}: {error}") from None
        missing = [str(path.name) for path in files if not path.is_file()]
        if missing:
            raise CorruptWeightsError(
                f"weights index {str(index)!r} names files that do not exist: {missing[:4]}"
            )
        return files
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
    tensor is read from its file, cast, and copied into its (merged, sharded) slot. A tensor
    whose shape disagrees with config.json is refused before it is read. The layers run
    `layer_ops` (default: the preferred ops for the device and dtype).
    """
    model = _empty_model(model_dir, hf_config, dtype, device, layer_ops)
    expected = {name for name, _ in model.named_parameters()}
    loaded: set[str] = set()
    for path in safetensors_files(model_dir):
        try:
            loaded |= _load_weights_file(model, path, dtype, device)
        except SafetensorError as error:
            raise CorruptWeightsError(
                f"weights file {str(path)!r} is not valid safetensors (truncated or damaged?): "
                f"{error}"
            ) from error
    missing = expected - loaded
    if missing:
        raise WeightsMismatchError(
            f"the weights in {str(model_dir)!r} do not match its config.json: no tensors for "
            f"{len(missing)} parameters, such as {sorted(missing)[:4]}"
        )
    model.finish_loading()
    num_packed = prepack_linear_weights(model)
    if num_packed:
        logger.info("%d linear weights prepacked for oneDNN", num_packed)
    return model.eval()


def _empty_model(
    model_dir: Path,
    hf_config,
    dtype: torch.dtype,
    device: torch.device,
    layer_ops: LayerOps | None,
) -> PackedModel:
    config_path = str(model_dir / "config.json")
    architectures = getattr(hf_config, "architectures", None) or []
    if not architectures:
        raise InvalidConfigError(f"{config_path!r} names no architectures")
    try:
        model_class = model_class_for(architectures[0])
        config = model_class.config_class.from_hf(hf_config)
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise InvalidConfigError(f"{config_path!r}: {error}") from None
    layer_ops = layer_ops or select_layer_ops(device, dtype)
    with torch.device("meta"), use_layer_ops(layer_ops):
        model = model_class(config).to(dtype)
    return model.to_empty(device=device)


def _load_weights_file(
    model: PackedModel, path: Path, dtype: torch.dtype, device: torch.device
) -> set[str]:
    """Copies one file's tensors into the model; returns the parameter names it filled."""
    loaded: set[str] = set()
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
            # Checked first: a narrow() into a merged or sharded slot would take a wrong-sized
            # tensor silently, and copy_() would broadcast one.
            shape = tuple(checkpoint.get_slice(hf_name).get_shape())
            if isinstance(module, ShardedParameters):
                expected_shape = tuple(module.checkpoint_shape(attr, shard_index))
            else:
                expected_shape = tuple(getattr(module, attr).shape)
            if shape != expected_shape:
                raise WeightsMismatchError(
                    f"tensor {hf_name!r} in {str(path)!r} has shape {list(shape)}, but config.json "
                    f"implies {list(expected_shape)}"
                )
            tensor = checkpoint.get_tensor(hf_name).to(device=device, dtype=dtype)
            if isinstance(module, ShardedParameters):
                module.load_shard(attr, tensor, shard_index)
            else:  # a plain torch layer, never sharded
                getattr(module, attr).data.copy_(tensor)
            loaded.add(name)
    return loaded
