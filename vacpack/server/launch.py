"""`vacpack serve`: load the model, then serve it over HTTP until SIGTERM or Ctrl-C.

On SIGTERM uvicorn stops accepting connections, lets in-flight requests finish for up to
`shutdown_timeout_s`, cancels what is left (which aborts those engine requests), and the app's
lifespan then stops the engine thread; the process then exits with status 0.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI

from vacpack.llm import LLM
from vacpack.openai_api.serving import generation_engine, pooling_functions
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
        config, async_engine, tokenizer, loaded.max_model_len, pooling, llm.sampling_defaults
    )
    app = build_app(handlers, metrics)
    # For a host's own health checks of the engine (Ray Serve's check_health).
    app.state.async_engine = async_engine
    return app


def serve(model: str, engine_kwargs: dict[str, Any], config: ServerConfig) -> int:
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    llm = LLM(model, **engine_kwargs)
    app = build_server_app(llm, config)
    freeze_startup_objects()  # the process serves this model until it exits
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level=config.log_level,
            timeout_graceful_shutdown=max(1, round(config.shutdown_timeout_s)),
            access_log=config.log_level == "debug",
        )
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
