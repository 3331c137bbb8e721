"""What every rank other than 0 runs: join the group, load its shard, then run rank 0's
programs until told to stop.

A worker holds no requests and no scheduler: each message names a program and its inputs
(vacpack/distributed/control.py), and the worker runs its shard's part of it with the same
code rank 0 runs: StepForward for engine steps, PackedForward for corpus bins, the model's LM
head for a corpus task's logits.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from vacpack.config import EngineConfig
from vacpack.corpus.forward import PackedForward
from vacpack.corpus.runner import select_corpus_attention
from vacpack.distributed.control import ControlChannel, Program
from vacpack.distributed.group import WorkerArgs, connect_to_store, join_group, rank_device
from vacpack.engine import step_inputs
from vacpack.engine.device_setup import setup_engine_device
from vacpack.engine.step_forward import StepForward
from vacpack.lora.manager import LoraManager
from vacpack.models.parallel import TensorParallel
from vacpack.runtime import LoadedModel, load

logger = logging.getLogger(__name__)


def run_worker(rank: int, args: WorkerArgs) -> None:
    config: EngineConfig = args.payload
    device = rank_device(args.device_type, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = connect_to_store(args)
    member = join_group(store, rank, args.size, args.device_type)
    tp = TensorParallel(rank, args.size, member.collectives)
    loaded = load(dataclasses.replace(config, device=str(device)), tp)
    _Worker(loaded, member.control).run()


class _Worker:
    def __init__(self, loaded: LoadedModel, control: ControlChannel) -> None:
        self.loaded = loaded
        self.control = control
        self.step_forward: StepForward | None = None  # after ENGINE_SETUP
        self.packed_forward: PackedForward | None = None  # on the first corpus program

    @torch.inference_mode()
    def run(self) -> None:
        while True:
            kind, payload = self.control.receive()
            if kind == Program.SHUTDOWN:
                return
            values = payload.tolist()
            if kind == Program.ENGINE_SETUP:
                (max_num_batched_tokens,) = values
                engine_config = self.loaded.engine_config
                setup = setup_engine_device(engine_config, self.loaded, max_num_batched_tokens)
                self.step_forward = setup.forward
                if engine_config.enable_lora:
                    setup.forward.lora = LoraManager.for_engine(
                        engine_config, self.loaded.model, self.loaded.device, self.loaded.dtype
                    )
            elif kind == Program.ENGINE_STEP:
                forward = self.step_forward
                assert forward is not None, "ENGINE_SETUP comes first"
                page_size = forward.kv_cache.page_size
                inputs = step_inputs.decode(values, page_size, forward.attention_windows)
                forward.run_as_worker(inputs)
            elif kind in (Program.PACKED_FORWARD, Program.LONG_DOCUMENT):
                if self.packed_forward is None:
                    attention = select_corpus_attention(self.loaded).backend
                    self.packed_forward = PackedForward(self.loaded, attention)
                self.packed_forward.run_as_worker(kind, values)
            elif kind == Program.LM_HEAD:
                self._lm_head(num_rows=values[0])
            elif kind == Program.LORA_ADAPTER:
                assert self.step_forward is not None and self.step_forward.lora is not None
                self.step_forward.lora.apply_change(values)
            else:
                raise ValueError(f"unknown program {kind!r}")

    def _lm_head(self, num_rows: int) -> None:
        loaded = self.loaded
        assert loaded.tp.collectives is not None
        hidden = torch.empty(
            num_rows, loaded.config.hidden_size, dtype=loaded.dtype, device=loaded.device
        )
        loaded.tp.collectives.broadcast(hidden)
        loaded.model.compute_logits(hidden)
