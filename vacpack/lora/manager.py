"""The engine's LoRA adapters: loaded once per id, kept, and assigned to a step's rows."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vacpack.config import EngineConfig
from vacpack.lora.adapter import read_adapter
from vacpack.lora.request import LoRARequest
from vacpack.lora.stacking import StackingShape, choose_stacked_max_rows
from vacpack.models.base import PackedModel
from vacpack.models.lora_layer import LinearLora, LoraRows, LoraState
from vacpack.models.parallel import ColumnParallelLinear, RowParallelLinear


class LoraManager:
    """Gives each of the model's linear layers (the LM head aside) a LinearLora, reads adapters
    into them on first use, and for each step tells them which rows run which adapter."""

    def __init__(
        self,
        model: PackedModel,
        device: torch.device,
        *,
        max_lora_rank: int,
        max_loras: int,
        dtype: torch.dtype,
    ) -> None:
        self.model = model
        self.max_lora_rank = max_lora_rank
        self.device = device
        self.state = LoraState()
        # Where a step's adapters stop running stacked, timed on the model's widest product.
        hidden_size = model.config.hidden_size
        shape = StackingShape(
            hidden_size,
            getattr(model.config, "intermediate_size", None) or hidden_size,
            max_loras,
            max_lora_rank,
            dtype,
        )
        self.state.stacked_max_rows, self.measured_choices = choose_stacked_max_rows(shape, device)
        self.layers: dict[str, LinearLora] = {}
        for name, module in model.named_modules():
            if isinstance(module, ColumnParallelLinear | RowParallelLinear):
                module.lora = self.layers[name] = LinearLora(self.state)
        self.adapters: dict[int, LoRARequest] = {}
        # Paths of removed adapters by id: their KV pages may still be in the prefix cache under
        # the id, so the id never serves another adapter.
        self._removed_paths: dict[int, str] = {}

    @classmethod
    def for_engine(
        cls, config: EngineConfig, model: PackedModel, device: torch.device, dtype: torch.dtype
    ) -> LoraManager:
        """The manager of an engine's model (on every tensor-parallel rank alike)."""
        return cls(
            model,
            device,
            max_lora_rank=config.max_lora_rank,
            max_loras=config.max_loras,
            dtype=dtype,
        )

    def add(self, request: LoRARequest) -> bool:
        """Loads the adapter unless its id is loaded already (then it must be the same one);
        True when it was loaded now. Raises ValueError for an adapter that does not fit the
        model, before any layer has it."""
        removed_path = self._removed_paths.get(request.lora_int_id)
        if removed_path is not None and removed_path != request.lora_path:
            raise ValueError(
                f"lora_int_id {request.lora_int_id} was adapter {removed_path!r}, removed: give "
                "another adapter another id"
            )
        known = self.adapters.get(request.lora_int_id)
        if known is not None:
            if known.lora_path != request.lora_path:
                raise ValueError(
                    f"lora_int_id {request.lora_int_id} is adapter {known.lora_name!r} "
                    f"({known.lora_path}), not {request.lora_path!r}: give each adapter its own id"
                )
            return False
        try:
            weights = read_adapter(request.lora_path, self.model, self.max_lora_rank, self.device)
        except ValueError as error:  # the loader's typed errors are ValueErrors too
            raise ValueError(f"LoRA adapter {request.lora_name!r}: {error}") from None
        for name, pair in weights.items():
            self.layers[name].set_weights(request.lora_int_id, pair)
        self.adapters[request.lora_int_id] = request
        return True

    def remove(self, lora_id: int) -> None:
        """Forgets the adapter (the caller checked that no sequence runs it)."""
        removed = self.adapters.pop(lora_id, None)
        if removed is not None:
            self._removed_paths[lora_id] = removed.lora_path
        for layer in self.layers.values():
            layer.set_weights(lora_id, None)

    # ---------------------------------------------------------------- tensor parallelism
    # Rank 0 loads or removes an adapter, then tells the other ranks (Program.LORA_ADAPTER):
    # [lora_int_id, 1 to load (then its path's UTF-8 bytes) or 0 to remove]. Each rank reads
    # its own slices of the same files.

    @staticmethod
    def change_message(lora_id: int, path: str | None) -> list[int]:
        """The message for loading adapter `lora_id` from `path`, or removing it (None)."""
        if path is None:
            return [lora_id, 0]
        return [lora_id, 1, *path.encode("utf-8")]

    def apply_change(self, message: list[int]) -> None:
        """Another rank: does what rank 0's change_message says."""
        lora_id, loads, *path_bytes = message
        if loads:
            path = bytes(path_bytes).decode("utf-8")
            self.add(LoRARequest(f"lora-{lora_id}", lora_id, path))
        else:
            self.remove(lora_id)

    def set_batch(self, rows_per_sequence: Sequence[int], lora_ids: Sequence[int]) -> None:
        """The next forward's rows: sequence i (in stream order) has rows_per_sequence[i] rows
        and runs adapter lora_ids[i] (0: the base model alone)."""
        adapter_ids = [lora_id for lora_id in dict.fromkeys(lora_ids) if lora_id]
        if not adapter_ids:
            self.state.batch = None
            return
        # Each row's adapter id, from which both ways of running them read their rows.
        row_lora_ids = torch.repeat_interleave(
            torch.tensor(lora_ids, dtype=torch.int64), torch.tensor(rows_per_sequence)
        )
        num_rows = len(row_lora_ids)
        batch = []
        for lora_id in adapter_ids:
            rows = (row_lora_ids == lora_id).nonzero().flatten()
            batch.append(
                LoraRows(
                    lora_id,
                    None if len(rows) == num_rows else rows.to(self.device, non_blocking=True),
                )
            )
        self.state.num_rows = num_rows
        self.state.row_lora_ids = row_lora_ids.to(self.device, non_blocking=True)
        self.state.batch = batch

    def clear_batch(self) -> None:
        self.state.batch = None
