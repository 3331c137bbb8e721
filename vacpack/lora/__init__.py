"""LoRA adapters over the engine's model, named as vLLM names them.

`LoRARequest` names an adapter (a PEFT checkpoint directory or hub id) for a request;
`adapter.py` reads one into the model's merged, packed linear layers; `LoraManager` keeps the
loaded adapters and tells the layers which rows of a step run which adapter.
"""

from vacpack.lora.request import LoRARequest

__all__ = ["LoRARequest"]
