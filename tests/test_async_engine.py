"""The server's engine thread (vacpack/server/async_engine.py) on a real engine: requests
stream their tokens, and a step that fails (an error no single request can be blamed for)
fails the requests in flight with a 500 while the thread carries on with the next ones; a
pooling request that fails alone spares those packed with it."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from vacpack import LLM, SamplingParams
from vacpack.engine.engine import LLMEngine
from vacpack.openai_api.errors import APIError
from vacpack.openai_api.pooling import prepare_embeddings, run_pooling_apart_on_failure
from vacpack.openai_api.protocol import EmbeddingRequest
from vacpack.openai_api.serving import generation_engine, pooling_functions
from vacpack.outputs import RequestOutput
from vacpack.ray.serve import VacpackServer
from vacpack.server.async_engine import UNHEALTHY_AFTER_FAILED_STEPS, AsyncEngine
from vacpack.server.metrics import ServerMetrics
from vacpack.server.request_stream import EngineRequest

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_checkpoint) -> Iterator[LLMEngine]:
    llm = LLM(str(tiny_checkpoint("qwen2")), dtype="float32", max_model_len=128)
    engine = generation_engine(llm)
    assert engine is not None
    yield engine


def _request(request_id: str, first_token: int) -> EngineRequest:
    return EngineRequest(request_id, [first_token, 7, 8, 9], GREEDY)


async def _tokens(async_engine: AsyncEngine, request: EngineRequest) -> list[int]:
    stream = await async_engine.submit([request])
    last = None
    async for output in stream:
        last = output
    assert last is not None and last.finished
    return list(last.outputs[0].token_ids)


def test_a_failed_step_fails_the_requests_in_it_and_the_thread_goes_on(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_step = engine.step
    failed: list[bool] = []

    def failing_once_both_are_in() -> list[RequestOutput]:
        outputs = real_step()
        if not failed and {"a", "b"} <= {output.request_id for output in outputs}:
            failed.append(True)
            raise RuntimeError("a device fault")
        return outputs

    async def scenario() -> tuple[list[int], list[BaseException | list[int]], list[int]]:
        async_engine = AsyncEngine(engine, ServerMetrics("tiny"))
        async_engine.start()
        try:
            alone = await _tokens(async_engine, _request("alone", 5))
            monkeypatch.setattr(engine, "step", failing_once_both_are_in)
            in_flight = await asyncio.gather(
                _tokens(async_engine, _request("a", 5)),
                _tokens(async_engine, _request("b", 6)),
                return_exceptions=True,
            )
            after = await _tokens(async_engine, _request("after", 5))
        finally:
            async_engine.stop()
        return alone, in_flight, after

    alone, in_flight, after = asyncio.run(scenario())
    assert failed  # the fault was injected into a step both requests were in
    assert len(alone) == GREEDY.max_tokens
    for result in in_flight:
        assert isinstance(result, APIError) and result.status_code == 500
        assert "the engine failed while running the request: a device fault" in str(result)
    # The failed requests' pages were freed and the loop went on: the next request runs as
    # the first did.
    assert after == alone
    assert not engine.has_unfinished_requests()


def test_a_pooling_request_that_fails_alone_spares_those_packed_with_it(tiny_checkpoint) -> None:
    # The server's and run-batch's pooling turn: requests that arrived together run as one
    # packed job; where that raises (a bug, a device fault: not a bad input, which is a 400),
    # each runs again alone and only the one that fails alone gets the 500.
    llm = LLM(str(tiny_checkpoint("qwen2")), dtype="float32", max_model_len=128)
    functions = pooling_functions(llm)
    assert functions.embed is not None
    embed = functions.embed
    calls: list[list[Any]] = []

    def embed_failing_on_poison(
        inputs: list[Any], dimensions: int | None, truncate_prompt_tokens: int | None
    ) -> list[Any]:
        calls.append(list(inputs))
        if "poison" in inputs:
            raise RuntimeError("a device fault")
        return embed(inputs, dimensions, truncate_prompt_tokens)

    functions = dataclasses.replace(functions, embed=embed_failing_on_poison)
    prepared = [
        prepare_embeddings(EmbeddingRequest(input=text), functions, "tiny")
        for text in ("a fine text", "poison", "another fine text")
    ]
    failures: list[int] = []

    def failure(index: int, error: Exception) -> APIError:
        failures.append(index)
        return APIError(500, f"the job failed: {error}")

    results = run_pooling_apart_on_failure(functions, prepared, failure)
    assert calls[0] == ["a fine text", "poison", "another fine text"]  # packed first
    assert failures == [1]
    assert isinstance(results[1], APIError) and results[1].status_code == 500
    for result in (results[0], results[2]):
        assert isinstance(result, dict) and len(result["data"][0]["embedding"]) > 0


def test_health_turns_503_after_steps_keep_failing_and_back_after_one_succeeds(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A fault that outlives its step (a CUDA device assert poisons the context) fails every
    # step after it: /health then says so, for whatever replaces replicas; one success heals.
    real_step = engine.step
    broken = [True]

    def step() -> list[RequestOutput]:
        outputs = real_step()
        if broken[0]:
            raise RuntimeError("device-side assert triggered")
        return outputs

    monkeypatch.setattr(engine, "step", step)

    # A Ray Serve replica asks the same engine (its check_health raising has Serve replace it).
    replica = SimpleNamespace(_engine=None)
    replica_check = functools.partial(VacpackServer.check_health, replica)

    async def scenario() -> list[str | None]:
        async_engine = AsyncEngine(engine, ServerMetrics("tiny"))
        replica._engine = async_engine
        replica_check()  # not started yet: nothing to check
        async_engine.start()
        health = [async_engine.health_problem]
        try:
            for attempt in range(UNHEALTHY_AFTER_FAILED_STEPS):
                with pytest.raises(APIError):
                    await _tokens(async_engine, _request(f"r{attempt}", 5))
                health.append(async_engine.health_problem)
            with pytest.raises(RuntimeError, match="unhealthy: the last 3 engine steps failed"):
                replica_check()
            broken[0] = False
            await _tokens(async_engine, _request("healed", 5))
            health.append(async_engine.health_problem)
            replica_check()
        finally:
            async_engine.stop()
        return health

    health = asyncio.run(scenario())
    assert health[0] is None and health[-1] is None
    assert health[1:-2] == [None] * (UNHEALTHY_AFTER_FAILED_STEPS - 1)
    assert health[-2] == (
        f"the last {UNHEALTHY_AFTER_FAILED_STEPS} engine steps failed: "
        "RuntimeError: device-side assert triggered"
    )


def test_when_the_drain_is_up_requests_running_and_arriving_get_503(engine: LLMEngine) -> None:
    # A graceful shutdown's last act before stopping: what still runs, and what arrives after,
    # is answered (a stream then ends with an error event) instead of being cut off.
    long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)

    async def scenario() -> tuple[BaseException | None, BaseException | None]:
        async_engine = AsyncEngine(engine, ServerMetrics("tiny"))
        async_engine.start()
        running_error = late_error = None
        try:
            stream = await async_engine.submit([EngineRequest("running", [5, 7, 8], long)])
            await anext(stream)  # it runs
            async_engine.end_drain()
            try:
                async for _ in stream:
                    pass
            except APIError as error:
                running_error = error
            try:
                await async_engine.submit([_request("late", 5)])
            except APIError as error:
                late_error = error
        finally:
            async_engine.stop()
        return running_error, late_error

    running_error, late_error = asyncio.run(scenario())
    for error in (running_error, late_error):
        assert isinstance(error, APIError) and error.status_code == 503 and error.code == "shutdown"
    assert not engine.has_unfinished_requests()
