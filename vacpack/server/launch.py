"""`vacpack serve`: load the model, then serve it over HTTP until SIGTERM or Ctrl-C.

On SIGTERM uvicorn stops accepting connections and lets in-flight requests finish for up to
`shutdown_timeout_s`; the engine then ends what is left with a 503 "the server is shutting down"
(a stream: an error event, then [DONE]), the app's lifespan stops the engine thread, and the
process exits with status 0.
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI

from vacpack.llm import LLM
from vacpack.openai_api.serving import (
    generation_engine,
    load_served_adapters,
    pooling_functions,
)
from vacpack.python_heap import freeze_startup_objects
from vacpack.server.app import build_app
from vacpack.server.async_engine import AsyncEngine
from vacpack.server.handlers import OpenAIHandlers
from vacpack.server.metrics import ServerMetrics
from vacpack.server.options import ServerConfig
from vacpack.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


def build_server_app(llm: LLM, config: ServerConfig) -> FastAPI:
    """The FastAPI app serving `llm`; the engine thread starts with the app's lifespan."""
    metrics = ServerMetrics(config.served_model_name)
    pooling = pooling_functions(llm)
    engine = generation_engine(llm)
    load_served_adapters(llm, engine, config.lora_requests)
    # Chosen now, at start: a model that only pools times its packed attention before serving.
    metrics.set_measured_choices(
        llm.loaded.measured_choices + engine.setup.measured_choices
        if engine is not None
        else llm.corpus_runner.measured_choices
    )
    async_engine = AsyncEngine(
        engine,
        metrics,
        pooling=pooling,
        max_waiting_requests=config.max_waiting_requests,
        retry_after_s=config.retry_after_s,
    )
    # The HTTP side tokenizes with its own tokenizer: the engine's belongs to the engine thread.
    loaded = llm.loaded
    tokenizer = load_tokenizer(
        llm.config.tokenizer or str(loaded.model_dir),
        trust_remote_code=llm.config.trust_remote_code,
        revision=llm.config.revision,
    )
    handlers = OpenAIHandlers(
        config,
        async_engine,
        tokenizer,
        loaded.max_model_len,
        pooling,
        llm.sampling_defaults,
        eos_token_ids=frozenset(loaded.eos_token_ids),
        scheduling_policy=llm.config.scheduling_policy,
    )
    app = build_app(handlers, metrics)
    # For a host's own health checks of the engine (Ray Serve's check_health).
    app.state.async_engine = async_engine
    return app


# Once the drain is up, how long the requests the engine ended have to send their last words (a
# stream's error event and [DONE]) before uvicorn cancels what is left: a client that stopped
# reading may never take them.
_LAST_WORDS_S = 5.0


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, but when a graceful shutdown's time is up the engine ends the requests
    still running (AsyncEngine.end_drain). uvicorn would cancel their tasks instead, which cuts a
    stream off mid-body, without [DONE], and answers a whole response with a bare-text 500."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, drain_s: float) -> None:
        super().__init__(config)
        self._engine = engine
        self._drain_s = drain_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        loop = asyncio.get_running_loop()
        drain_is_up = loop.call_later(self._drain_s, self._engine.end_drain)
        try:
            await super().shutdown(sockets)
        finally:
            drain_is_up.cancel()


def serve(model: str, engine_kwargs: dict[str, Any], config: ServerConfig) -> int:
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    llm = LLM(model, **engine_kwargs)
    app = build_server_app(llm, config)
    freeze_startup_objects()  # the process serves this model until it exits
    server = _DrainingServer(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level=config.log_level,
            timeout_graceful_shutdown=math.ceil(config.shutdown_timeout_s + _LAST_WORDS_S),
            access_log=config.log_level == "debug",
        ),
        app.state.async_engine,
        config.shutdown_timeout_s,
    )
    logger.info("serving %s on http://%s:%d", config.served_model_name, config.host, config.port)
    with _sigterm_after_drain_is_harmless():
        server.run()
    logger.info("server stopped")
    return 0


@contextmanager
def _sigterm_after_drain_is_harmless() -> Iterator[None]:
    """Once it has drained, uvicorn raises the SIGTERM it caught again, for the handler it found
    installed. The default handler would kill the process after a clean shutdown (exit status
    -15, which supervisors read as a crash); this one lets `serve` return 0 instead."""
    previous = signal.signal(signal.SIGTERM, _drained)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _drained(signum: int, frame: FrameType | None) -> None:
    """Nothing is left to do: uvicorn has drained and the lifespan has stopped the engine."""
