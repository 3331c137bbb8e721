"""The engine on a thread of its own, bridged to asyncio.

The engine is not thread-safe, so exactly one thread touches it: a loop that drains a queue of
commands (add, abort, pooling jobs, stop), then steps while there is work, then blocks on the
queue. Embedding, score and rerank requests are pooling jobs: those that arrive together run as
packed corpus jobs between two steps.
Outputs go back to the event loop with one `call_soon_threadsafe` per step, into a per-request
asyncio.Queue, so a slow client never holds up the engine or another request.

Anything a request does wrong is caught on the engine thread and sent to that request only; an
error inside a step (which cannot be pinned on one request) fails the requests in flight, and
the loop carries on (health_problem says when steps keep failing).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from vacpack.engine.engine import LLMEngine
from vacpack.openai_api.errors import APIError, bad_request, refused_by_engine
from vacpack.openai_api.pooling import PreparedPooling, run_pooling_apart_on_failure
from vacpack.openai_api.serving import PoolingFunctions
from vacpack.server.metrics import ServerMetrics
from vacpack.server.request_stream import ACCEPTED, EngineRequest, RequestStream

logger = logging.getLogger(__name__)

T = TypeVar("T")

# After this many engine steps in a row have failed, /health reports the engine unhealthy, so
# that what watches it (a load balancer, Kubernetes' probes, Ray Serve's check_health) can
# replace this server: a fault that outlives its step (a CUDA device assert poisons the
# context) fails every step after it, while one failed step alone says little.
UNHEALTHY_AFTER_FAILED_STEPS = 3


@dataclass(frozen=True)
class _Add:
    requests: list[EngineRequest]
    stream: RequestStream
    arrival_s: float


@dataclass(frozen=True)
class _Abort:
    request_ids: list[str]


@dataclass(frozen=True)
class _Pool:
    prepared: PreparedPooling
    future: asyncio.Future[dict[str, Any]]


@dataclass(frozen=True)
class _Call:
    """A function of the engine, run on the engine thread between two steps."""

    function: Callable[[LLMEngine], Any]
    future: asyncio.Future[Any]


class _EndDrain:
    pass


class _Stop:
    pass


@dataclass
class _Timing:
    arrival_s: float
    last_output_s: float | None = None


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine | None,
        metrics: ServerMetrics,
        *,
        pooling: PoolingFunctions | None = None,
        max_waiting_requests: int | None = None,
        retry_after_s: int = 1,
    ) -> None:
        self._engine = engine
        self._pooling = pooling
        self._metrics = metrics
        self._max_waiting = max_waiting_requests
        self._retry_after_s = retry_after_s
        self._commands: queue.SimpleQueue[_Add | _Abort | _Pool | _Call | _EndDrain | _Stop] = (
            queue.SimpleQueue()
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # Engine-thread state: which stream each engine request reports to, and its timing.
        self._streams: dict[str, RequestStream] = {}
        self._timings: dict[str, _Timing] = {}
        # What this turn of the loop sends to streams: handed over in one call per turn.
        self._deliveries: list[tuple[RequestStream, Any]] = []
        # Once a graceful shutdown's drain is up: what every request after it is answered.
        self._refusal: APIError | None = None
        # Written by the engine thread, read by /health (an int and a str: atomic to read).
        self._failed_steps_in_a_row = 0
        self._last_step_error = ""

    @property
    def serves_generation(self) -> bool:
        return self._engine is not None

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def health_problem(self) -> str | None:
        """Why the engine cannot serve (for /health's 503), or None while it can."""
        if not self.is_alive:
            return "the engine thread is not running"
        failed = self._failed_steps_in_a_row
        if failed >= UNHEALTHY_AFTER_FAILED_STEPS:
            return f"the last {failed} engine steps failed: {self._last_step_error}"
        return None

    # ------------------------------------------------------------ the event loop's side
    def start(self) -> None:
        """Starts the engine thread; call from the event loop that will consume outputs."""
        self._loop = asyncio.get_running_loop()
        # The pool's size is on /metrics before the first request; no engine thread runs yet.
        self._publish_state()
        self._thread = threading.Thread(target=self._run, name="vacpack-engine", daemon=True)
        self._thread.start()

    def end_drain(self) -> None:
        """Ends a graceful shutdown's drain: every request still running, and every one after
        it, is answered 503 "the server is shutting down" (a stream: an error event, then
        [DONE]), so that each ends as a response should rather than being cut off."""
        self._commands.put(_EndDrain())

    def stop(self, timeout_s: float = 10.0) -> None:
        """Aborts what is left and ends the engine thread."""
        if self._thread is None:
            return
        self._commands.put(_Stop())
        self._thread.join(timeout_s)

    async def submit(self, requests: list[EngineRequest]) -> RequestStream:
        """Hands requests to the engine; returns once it took them, raising APIError if not."""
        stream = RequestStream([r.request_id for r in requests])
        self._commands.put(_Add(requests, stream, time.perf_counter()))
        try:
            await stream.wait_accepted()
        except asyncio.CancelledError:
            self.abort(stream.request_ids)
            raise
        return stream

    def abort(self, request_ids: Sequence[str]) -> None:
        """Frees the requests' KV pages at the engine's next turn; unknown ids are ignored."""
        self._commands.put(_Abort(list(request_ids)))

    async def pool(self, prepared: PreparedPooling) -> dict[str, Any]:
        """An embedding, score or rerank response body, computed on the engine thread;
        APIError 400 for a bad input."""
        assert self._loop is not None, "start() first"
        future: asyncio.Future[dict[str, Any]] = self._loop.create_future()
        self._commands.put(_Pool(prepared, future))
        return await future

    async def call(self, function: Callable[[LLMEngine], T]) -> T:
        """`function(engine)` on the engine thread between two steps (the engine is not
        thread-safe): loading or removing a LoRA adapter, say. Its exception is raised here."""
        assert self._loop is not None, "start() first"
        future: asyncio.Future[T] = self._loop.create_future()
        self._commands.put(_Call(function, future))
        return await future

    # ------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        running = True
        while running:
            try:
                running = self._handle_commands()
                if running and self._engine is not None and self._engine.has_unfinished_requests():
                    self._step()
                self._publish_state()
            except Exception:  # the loop must outlive any one failure
                logger.exception("engine loop error")
            self._flush_deliveries()

    def _handle_commands(self) -> bool:
        """Runs queued commands, blocking for one when there is no work; False on stop."""
        idle = self._engine is None or not self._engine.has_unfinished_requests()
        commands = [self._commands.get()] if idle else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                break
        pool_jobs: list[_Pool] = []
        for command in commands:
            if isinstance(command, _Stop):
                shutting_down = _shutting_down()
                self._abort_all(shutting_down)
                self._settle_pool_jobs(pool_jobs, [shutting_down] * len(pool_jobs))
                return False
            if isinstance(command, _EndDrain):
                self._refusal = _shutting_down()
                self._abort_all(self._refusal)
            elif isinstance(command, _Add):
                self._add(command)
            elif isinstance(command, _Abort):
                self._abort(command.request_ids)
            elif isinstance(command, _Call):
                self._call(command)
            else:
                pool_jobs.append(command)
        if pool_jobs and self._refusal is not None:
            self._settle_pool_jobs(pool_jobs, [self._refusal] * len(pool_jobs))
        elif pool_jobs:
            self._run_pool_jobs(pool_jobs)
        return True

    def _add(self, command: _Add) -> None:
        engine = self._engine
        if engine is None:
            self._deliver(command.stream, bad_request("this model does not generate text", "model"))
            return
        if self._refusal is not None:
            self._deliver(command.stream, self._refusal)
            return
        num_waiting = engine.state().num_waiting_sequences
        if self._max_waiting is not None and num_waiting >= self._max_waiting:
            self._metrics.requests_rejected.inc()
            error = APIError(
                503,
                f"the server is busy: {num_waiting} sequences are waiting; retry later",
                code="server_overloaded",
                headers={"Retry-After": str(self._retry_after_s)},
            )
            self._deliver(command.stream, error)
            return
        added: list[str] = []
        try:
            for index, request in enumerate(command.requests):
                try:
                    engine.add_request(
                        request.request_id,
                        request.prompt_token_ids,
                        request.params,
                        request.prompt,
                        lora_request=request.lora_request,
                        priority=request.priority,
                    )
                except ValueError as error:
                    where = f"prompt {index}: " if len(command.requests) > 1 else ""
                    raise refused_by_engine(error, where) from None
                added.append(request.request_id)
        except Exception as error:
            for request_id in added:
                engine.abort_request(request_id)
            if not isinstance(error, APIError):
                logger.exception("adding a request failed")
                error = APIError(500, f"the engine could not take the request: {error}")
            self._deliver(command.stream, error)
            return
        for request in command.requests:
            self._streams[request.request_id] = command.stream
            self._timings[request.request_id] = _Timing(command.arrival_s)
            self._metrics.prompt_tokens.inc(len(request.prompt_token_ids))
        self._deliver(command.stream, ACCEPTED)

    def _abort(self, request_ids: list[str]) -> None:
        if self._engine is None:
            return
        for request_id in request_ids:
            if self._streams.pop(request_id, None) is not None:
                self._timings.pop(request_id, None)
                self._engine.abort_request(request_id)
                self._metrics.requests_aborted.inc()

    def _abort_all(self, error: APIError) -> None:
        streams = dict(self._streams)
        if streams:
            self._abort(list(streams))
        for stream in set(streams.values()):
            self._deliver(stream, error)

    def _run_pool_jobs(self, commands: list[_Pool]) -> None:
        """Pooling requests that arrived together run as packed jobs, one per kind of job;
        where those fail, each runs alone, so that only a request that fails alone gets a 500."""
        assert self._pooling is not None, "requests are prepared with the model's functions"

        def failure(index: int, error: Exception) -> APIError:
            logger.error("a pooling request failed", exc_info=error)
            return APIError(500, f"the job failed: {error}")

        prepared = [command.prepared for command in commands]
        results = run_pooling_apart_on_failure(self._pooling, prepared, failure)
        self._settle_pool_jobs(commands, results)

    def _call(self, command: _Call) -> None:
        result: Any
        if self._engine is None:
            result = bad_request("this model does not generate text", "model")
        else:
            try:
                result = command.function(self._engine)
            except Exception as error:  # the caller's to answer
                result = error
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the event loop has closed
            self._loop.call_soon_threadsafe(_settle, command.future, result)

    def _settle_pool_jobs(self, commands: list[_Pool], results: list[Any]) -> None:
        assert self._loop is not None
        for command, result in zip(commands, results, strict=True):
            with contextlib.suppress(RuntimeError):  # the event loop has closed
                self._loop.call_soon_threadsafe(_settle, command.future, result)

    def _step(self) -> None:
        assert self._engine is not None
        try:
            outputs = self._engine.step()
        except Exception as error:
            logger.exception(
                "engine step failed; failing the %d requests in it", len(self._streams)
            )
            self._last_step_error = f"{type(error).__name__}: {error}"
            self._failed_steps_in_a_row += 1
            self._abort_all(APIError(500, f"the engine failed while running the request: {error}"))
            return
        self._failed_steps_in_a_row = 0
        now = time.perf_counter()
        metrics = self._metrics
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # aborted after this step was scheduled
            timing = self._timings[output.request_id]
            num_new_tokens = sum(len(c.token_ids) for c in output.outputs)
            if num_new_tokens:
                metrics.generation_tokens.inc(num_new_tokens)
                if timing.last_output_s is None:
                    metrics.time_to_first_token.observe(now - timing.arrival_s)
                else:
                    metrics.inter_token_latency.observe(now - timing.last_output_s)
                timing.last_output_s = now
            for completion in output.outputs:
                if completion.finish_reason is not None:
                    metrics.count_finished(completion.finish_reason)
            if output.finished:
                metrics.e2e_request_latency.observe(now - timing.arrival_s)
                del self._streams[output.request_id]
                del self._timings[output.request_id]
            self._deliver(stream, output)

    def _publish_state(self) -> None:
        if self._engine is not None:
            self._metrics.set_engine_state(self._engine.state())

    def _deliver(self, stream: RequestStream, item: Any) -> None:
        self._deliveries.append((stream, item))

    def _flush_deliveries(self) -> None:
        if not self._deliveries:
            return
        deliveries, self._deliveries = self._deliveries, []
        assert self._loop is not None
        # A closed event loop raises RuntimeError: nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(_put_all, deliveries)


def _shutting_down() -> APIError:
    return APIError(503, "the server is shutting down", code="shutdown")


def _put_all(deliveries: list[tuple[RequestStream, Any]]) -> None:
    for stream, item in deliveries:
        stream.put(item)


def _settle(future: asyncio.Future[Any], result: Any) -> None:
    if future.done():  # the client went away meanwhile
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)
