"""vLLM's runtime LoRA endpoints (POST /v1/load_lora_adapter and /v1/unload_lora_adapter, served
with --allow-runtime-lora-updating): adapters added and removed while the server runs.

The engine loads and drops an adapter on its own thread between two steps (AsyncEngine.call),
so a step never sees half an adapter. An adapter still running a request is not unloaded (409).
Ids are never reused: a removed adapter's KV pages may linger in the prefix cache under its id.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Mapping

from vacpack.lora.request import LoRARequest
from vacpack.openai_api.errors import APIError, bad_request
from vacpack.openai_api.protocol import (
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
    parse_body,
)
from vacpack.server.async_engine import AsyncEngine


class ServedAdapters:
    """The adapters a request's `model` may name, by name."""

    def __init__(self, served_model_name: str, adapters: Mapping[str, LoRARequest]) -> None:
        self.served_model_name = served_model_name
        self.by_name: dict[str, LoRARequest] = dict(adapters)
        first_id = max((a.lora_int_id for a in adapters.values()), default=0) + 1
        self._next_ids = itertools.count(first_id)
        self._lock = asyncio.Lock()  # one change at a time: a name is checked, then taken

    async def load(self, engine: AsyncEngine, body: bytes) -> str:
        request = parse_body(LoadLoRAAdapterRequest, body)
        async with self._lock:
            name = request.lora_name
            if name == self.served_model_name or name in self.by_name:
                raise bad_request(f"a model named `{name}` is served already", "lora_name")
            adapter = LoRARequest(name, next(self._next_ids), request.lora_path)
            try:
                await engine.call(lambda llm_engine: llm_engine.add_adapter(adapter))
            except ValueError as error:
                raise bad_request(str(error), "lora_path") from None
            self.by_name[name] = adapter
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, engine: AsyncEngine, body: bytes) -> str:
        request = parse_body(UnloadLoRAAdapterRequest, body)
        async with self._lock:
            adapter = self.by_name.get(request.lora_name)
            if adapter is None or request.lora_int_id not in (None, adapter.lora_int_id):
                raise APIError(
                    404,
                    f"no LoRA adapter `{request.lora_name}` is served",
                    param="lora_name",
                    code="model_not_found",
                )
            try:
                await engine.call(lambda llm_engine: llm_engine.remove_adapter(adapter.lora_int_id))
            except ValueError as error:
                raise APIError(409, str(error), param="lora_name", code="adapter_in_use") from None
            del self.by_name[request.lora_name]
        return f"Success: LoRA adapter '{request.lora_name}' removed successfully."
