"""Rank 0 starts a tensor-parallel group: checks, spawns the other ranks, loads its shard."""

from __future__ import annotations

import dataclasses
import logging

import torch

from vacpack.config import EngineConfig
from vacpack.device import resolve_device
from vacpack.distributed.driver import Driver
from vacpack.distributed.group import rank_device, start_group
from vacpack.models.hub import resolve_model_path
from vacpack.models.loader import build_model, load_hf_config
from vacpack.models.parallel import TensorParallel
from vacpack.runtime import LoadDtypes, LoadedModel, load, resolve_load_dtype
from vacpack.tensor_parallel.worker import run_worker

logger = logging.getLogger(__name__)


def load_tensor_parallel(config: EngineConfig) -> LoadedModel:
    """Rank 0's LoadedModel of a model split over config.tensor_parallel_size processes.

    What can be checked in this process is checked before any other starts: the devices, the
    checkpoint, and that the model splits that many ways. The dtype is resolved here (measured,
    for auto on a CPU) and given to every rank, so that all compute in the same one. On a CPU
    each rank takes 1/N of the cores unless num_threads says otherwise.
    """
    size = config.tensor_parallel_size
    device = resolve_device(config.device)
    _check_devices(config, device, size)
    model_dir = resolve_model_path(config.model, config.revision)
    hf_config = load_hf_config(model_dir, config.trust_remote_code)
    dtypes = resolve_load_dtype(config, hf_config, device)
    build_model(
        model_dir,
        hf_config,
        dtypes.dtype,
        device,
        tp=TensorParallel(0, size),
        weight_dtype=dtypes.weight_dtype,
    )
    rank_config = dataclasses.replace(
        config,
        dtype=str(dtypes.weight_dtype).removeprefix("torch."),
        cpu_bf16_arithmetic=_arithmetic(dtypes, config.cpu_bf16_arithmetic),
        num_threads=config.num_threads or max(1, torch.get_num_threads() // size),
    )
    member, workers, store = start_group(size, device.type, run_worker, rank_config)
    driver = Driver(member, workers, store)
    logger.info("tensor parallel: %d ranks on %s (worker pids %s)", size, device, workers.pids)
    with driver.startup():
        loaded = load(
            dataclasses.replace(rank_config, device=str(rank_device(device.type, 0))),
            TensorParallel(0, size, member.collectives),
            driver,
        )
    # The dtypes were chosen here, before the ranks started (each loaded them as given: its
    # record of a forced choice gives way to the measurement).
    chosen_here = {choice.phase for choice in dtypes.choices}
    rank_choices = tuple(c for c in loaded.measured_choices if c.phase not in chosen_here)
    return dataclasses.replace(loaded, measured_choices=dtypes.choices + rank_choices)


def _arithmetic(dtypes: LoadDtypes, asked: str) -> str:
    """The bfloat16 arithmetic every rank runs: the one chosen here, where one was."""
    if dtypes.weight_dtype != torch.bfloat16:
        return asked
    return str(dtypes.dtype).removeprefix("torch.")


def _check_devices(config: EngineConfig, device: torch.device, size: int) -> None:
    if device.type != "cuda":
        return
    if device.index is not None:
        raise ValueError(
            f"device {config.device!r} names one GPU; with tensor_parallel_size={size} give "
            "device 'cuda' (or auto): rank r runs on GPU r (set CUDA_VISIBLE_DEVICES to choose)"
        )
    available = torch.cuda.device_count()
    if available < size:
        raise ValueError(
            f"tensor_parallel_size={size} needs {size} GPUs; this machine shows {available}"
        )
