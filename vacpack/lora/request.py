"""LoRARequest: vLLM's name for a request's adapter."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter for a request: `lora_int_id` (>= 1) identifies it in the engine (two
    requests with the same id share it), `lora_path` is its PEFT checkpoint (a directory with
    adapter_config.json, or a hub id), `lora_name` what outputs and the server call it."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an int >= 1, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
        if not self.lora_path:
            raise ValueError("lora_path must not be empty")
