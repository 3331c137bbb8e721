"""Reading a checkpoint's config and streaming its weights into our model."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
from vacpack.models.parallel import (
    SINGLE_RANK,
    LinearKernelFor,
    TensorParallel,
    prepack_linear_weights,
    store_weights_as,
)
from vacpack.models.registry import DECODER_BODIES, model_class_for

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


def build_model(
    model_dir: Path,
    hf_config: Any,
    dtype: torch.dtype,
    device: torch.device,
    layer_ops: LayerOps | None = None,
    tp: TensorParallel = SINGLE_RANK,
    weight_dtype: torch.dtype | None = None,
) -> PackedModel:
    """The model for `hf_config` (this rank's shard of it), on the meta device: its shapes, no
    memory, in `dtype`, but for the weights of its linear layers and vocabulary tables where
    `weight_dtype` differs (parallel.store_weights_as). Raises InvalidConfigError where it
    cannot be built, ValueError where it cannot be split over tp.size ranks. The layers run
    `layer_ops` (default: the preferred ops for the device and dtype)."""
    config_path = str(model_dir / "config.json")
    architectures = getattr(hf_config, "architectures", None) or []
    if not architectures:
        raise InvalidConfigError(f"{config_path!r} names no architectures")
    architecture = architectures[0]
    if architecture in DECODER_BODIES and _saved_without_lm_head(model_dir, hf_config):
        logger.info(
            "%s holds no lm_head: loaded as %s, which embeds and cannot generate",
            config_path,
            DECODER_BODIES[architecture],
        )
        architecture = DECODER_BODIES[architecture]
    try:
        model_class = model_class_for(architecture)
        config = model_class.config_class.from_hf(hf_config)
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise InvalidConfigError(f"{config_path!r}: {error}") from None
    layer_ops = layer_ops or select_layer_ops(device, dtype)
    with torch.device("meta"), use_layer_ops(layer_ops):
        model = model_class(config, tp).to(dtype)
        if weight_dtype is not None and weight_dtype != dtype:
            store_weights_as(model, weight_dtype)
        return model


def _saved_without_lm_head(model_dir: Path, hf_config: Any) -> bool:
    """Whether an untied causal LM's checkpoint lacks its LM head (read from the files'
    headers); False where there are no weights to read (a meta-only build)."""
    if getattr(hf_config, "tie_word_embeddings", False):
        return False
    try:
        files = safetensors_files(model_dir)
    except (ModelNotFoundError, CorruptWeightsError):
        return False  # loading reports it
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as checkpoint:
                names = checkpoint.keys()  # safe_open is not a dict
            if any(name.endswith("lm_head.weight") for name in names):
                return False
        except (OSError, SafetensorError):
            return False  # loading reports it
    return True


def load_model(
    model_dir: Path,
    hf_config,
    dtype: torch.dtype,
    device: torch.device,
    layer_ops: LayerOps | None = None,
) -> PackedModel:
    """The whole model on one device (see load_model_shard)."""
    return load_model_shard(model_dir, hf_config, dtype, device, layer_ops)[0]


def load_model_shard(
    model_dir: Path,
    hf_config,
    dtype: torch.dtype,
    device: torch.device,
    layer_ops: LayerOps | None = None,
    tp: TensorParallel = SINGLE_RANK,
    linear_kernel_for: LinearKernelFor | None = None,
    weight_dtype: torch.dtype | None = None,
    gate_in_kernel: bool = True,
) -> tuple[PackedModel, LoadStats]:
    """Builds this rank's part of the model on the meta device, then streams each checkpoint
    tensor's slice for this rank into place (`weight_dtype`: see build_model).

    Nothing is materialised twice: parameters are allocated once on the target device and each
    layer reads from the file only the rows or columns it keeps, casts them to the parameter's
    dtype, and copies them into its (merged, sharded) slot. A tensor whose shape disagrees with
    config.json is refused before it is read.
    """
    model = build_model(model_dir, hf_config, dtype, device, layer_ops, tp, weight_dtype)
    model = model.to_empty(device=device)
    expected = {name for name, _ in model.named_parameters()}
    loaded: set[str] = set()
    bytes_read = 0
    for path in safetensors_files(model_dir):
        try:
            file_loaded, file_bytes_read = _load_weights_file(model, path, dtype, device)
        except SafetensorError as error:
            raise CorruptWeightsError(
                f"weights file {str(path)!r} is not valid safetensors (truncated or damaged?): "
                f"{error}"
            ) from error
        loaded |= file_loaded
        bytes_read += file_bytes_read
    missing = expected - loaded
    if missing:
        raise WeightsMismatchError(
            f"the weights in {str(model_dir)!r} do not match its config.json: no tensors for "
            f"{len(missing)} parameters, such as {sorted(missing)[:4]}"
        )
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model.finish_loading()
    num_packed = prepack_linear_weights(model, linear_kernel_for, gate_in_kernel)
    if num_packed:
        logger.info("%d linear weights prepacked", num_packed)
    return model.eval(), LoadStats(bytes_read, parameter_bytes)


def _load_weights_file(
    model: PackedModel, path: Path, dtype: torch.dtype, device: torch.device
) -> tuple[set[str], int]:
    """Copies this rank's part of one file's tensors into the model, each cast to its
    parameter's dtype (`dtype` where the layer lacks it: its load_shard says so); returns the
    parameter names it filled and the bytes it read."""
    loaded: set[str] = set()
    bytes_read = 0
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
            parameter = getattr(module, attr, None)
            read_as = parameter.dtype if isinstance(parameter, torch.Tensor) else dtype
            source = _CheckpointTensor(checkpoint, hf_name, read_as, device)
            # Checked first: a narrow() into a merged or sharded slot would take a wrong-sized
            # tensor silently, and copy_() would broadcast one.
            if isinstance(module, ShardedParameters):
                expected_shape = tuple(module.checkpoint_shape(attr, shard_index))
            else:
                expected_shape = tuple(getattr(module, attr).shape)
            if source.shape != expected_shape:
                raise WeightsMismatchError(
                    f"tensor {hf_name!r} in {str(path)!r} has shape {list(source.shape)}, but "
                    f"config.json implies {list(expected_shape)}"
                )
            if isinstance(module, ShardedParameters):
                module.load_shard(attr, source, shard_index)
            else:  # a plain torch layer, never sharded
                getattr(module, attr).data.copy_(source.read())
            bytes_read += source.bytes_read
            loaded.add(name)
    return loaded, bytes_read
