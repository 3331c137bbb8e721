"""Beam search for the server: a BeamSearch driven over the engine thread, one engine request
per live beam and step, the beams' shared tokens found in the prefix cache."""

from __future__ import annotations

import itertools
from collections.abc import AsyncGenerator, Set

from transformers import PreTrainedTokenizerBase

from vacpack.beam_search import BeamSearch, beam_request_output
from vacpack.openai_api.requests import PreparedGeneration
from vacpack.outputs import PositionLogprobs, RequestOutput
from vacpack.server.async_engine import AsyncEngine
from vacpack.server.request_stream import EngineRequest


async def beam_search_outputs(
    engine: AsyncEngine,
    prepared: PreparedGeneration,
    response_id: str,
    eos_token_ids: Set[int],
    max_model_len: int,
    tokenizer: PreTrainedTokenizerBase,
) -> AsyncGenerator[RequestOutput, None]:
    """Each prompt's hypotheses as one finished output (request id `{response_id}-{index}`,
    as a sampled request's), once the search is over. Cancelled, it aborts the beams' requests
    in flight."""
    assert prepared.beam_search is not None
    search = BeamSearch(
        [prompt.token_ids for prompt in prepared.prompts],
        prepared.beam_search,
        eos_token_ids,
        max_model_len,
    )
    for step in itertools.count():
        beams = search.beams_to_extend()
        if not beams:
            break
        requests = [
            EngineRequest(
                f"{response_id}-beam-{step}-{index}",
                tokens,
                search.step_params,
                lora_request=prepared.lora_request,
            )
            for index, tokens in enumerate(beams)
        ]
        search.advance(await _next_token_positions(engine, requests))
    outputs = search.outputs(tokenizer)
    for index, (prompt, output) in enumerate(zip(prepared.prompts, outputs, strict=True)):
        yield beam_request_output(f"{response_id}-{index}", prompt.text, prompt.token_ids, output)


async def _next_token_positions(
    engine: AsyncEngine, requests: list[EngineRequest]
) -> list[PositionLogprobs]:
    stream = await engine.submit(requests)
    positions: dict[str, PositionLogprobs] = {}
    try:
        async for output in stream:
            if output.finished:
                (positions[output.request_id],) = output.outputs[0].logprobs or [{}]
    finally:
        if not stream.finished:
            engine.abort(stream.request_ids)
    return [positions[request.request_id] for request in requests]
