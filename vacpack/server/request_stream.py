"""A client request's side of the engine thread (async_engine.py): the engine requests it
adds, and the stream the engine thread answers it on."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from vacpack.lora.request import LoRARequest
from vacpack.outputs import RequestOutput
from vacpack.sampling import SamplingParams


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    lora_request: LoRARequest | None = None
    priority: int = 0


class Accepted:
    """The engine thread took a stream's requests into the engine."""


ACCEPTED = Accepted()


class RequestStream:
    """What the engine thread sends one client request: an acceptance, then outputs, or an error.

    Iterating yields RequestOutputs until every engine request in it has finished; an error sent
    by the engine thread is raised instead.
    """

    def __init__(self, request_ids: Sequence[str]) -> None:
        self.request_ids = list(request_ids)
        self._unfinished = set(request_ids)
        self._items: asyncio.Queue[RequestOutput | BaseException | Accepted] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException | Accepted) -> None:
        self._items.put_nowait(item)

    @property
    def finished(self) -> bool:
        return not self._unfinished

    async def wait_accepted(self) -> None:
        item = await self._items.get()
        if isinstance(item, BaseException):
            raise item

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._unfinished:
            raise StopAsyncIteration
        item = await self._items.get()
        if isinstance(item, BaseException):
            self._unfinished.clear()
            raise item
        assert isinstance(item, RequestOutput)
        if item.finished:
            self._unfinished.discard(item.request_id)
        return item
