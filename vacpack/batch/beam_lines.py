"""run-batch's beam-search lines (`"use_beam_search": true`): each line's BeamSearch runs its
step requests in the engine beside the other lines' requests; once every beam of a step has its
next-token log-probabilities, the search advances and adds the next step's requests."""

from __future__ import annotations

import itertools
from collections.abc import Set
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from transformers import PreTrainedTokenizerBase

from vacpack.beam_search import BeamSearch, beam_request_output
from vacpack.engine.engine import LLMEngine
from vacpack.openai_api.requests import PreparedGeneration
from vacpack.openai_api.responses import PromptResult
from vacpack.outputs import PositionLogprobs, RequestOutput

Line = TypeVar("Line")


@dataclass
class _Search(Generic[Line]):
    line: Line
    response_id: str
    prepared: PreparedGeneration
    search: BeamSearch
    steps: itertools.count = field(default_factory=itertools.count)
    step_ids: list[str] = field(default_factory=list)  # this step's requests, in beam order
    positions: dict[str, PositionLogprobs] = field(default_factory=dict)


@dataclass(frozen=True)
class BeamLineEnd(Generic[Line]):
    """A line whose search is over: its results, or the error that ended it (the engine
    refused a step's request)."""

    line: Line
    response_id: str
    results: list[PromptResult] | None = None
    error: Exception | None = None


class BeamLines(Generic[Line]):
    def __init__(
        self,
        engine: LLMEngine,
        eos_token_ids: Set[int],
        max_model_len: int,
        tokenizer: PreTrainedTokenizerBase,
    ) -> None:
        self._engine = engine
        self._eos_token_ids = eos_token_ids
        self._max_model_len = max_model_len
        self._tokenizer = tokenizer
        self._by_request: dict[str, _Search[Line]] = {}

    @property
    def request_ids(self) -> list[str]:
        """The engine requests in flight for beam searches."""
        return list(self._by_request)

    def owns(self, request_id: str) -> bool:
        return request_id in self._by_request

    def start(
        self, line: Line, response_id: str, prepared: PreparedGeneration
    ) -> list[PromptResult] | None:
        """Adds the line's first step (ValueError if the engine refuses it, nothing left in
        flight); its results when the search is already over."""
        assert prepared.beam_search is not None
        search = BeamSearch(
            [prompt.token_ids for prompt in prepared.prompts],
            prepared.beam_search,
            self._eos_token_ids,
            self._max_model_len,
        )
        return self._next_step(_Search(line, response_id, prepared, search))

    def on_output(self, output: RequestOutput) -> BeamLineEnd[Line] | None:
        """Takes a finished step request's output; the line's end once its search is over."""
        searching = self._by_request.pop(output.request_id)
        (searching.positions[output.request_id],) = output.outputs[0].logprobs or [{}]
        if len(searching.positions) < len(searching.step_ids):
            return None
        searching.search.advance([searching.positions[i] for i in searching.step_ids])
        try:
            results = self._next_step(searching)
        except Exception as error:
            return BeamLineEnd(searching.line, searching.response_id, error=error)
        return (
            None if results is None else BeamLineEnd(searching.line, searching.response_id, results)
        )

    def _next_step(self, searching: _Search[Line]) -> list[PromptResult] | None:
        beams = searching.search.beams_to_extend()
        if not beams:
            return self._results(searching)
        step = next(searching.steps)
        searching.step_ids = [f"{searching.response_id}-beam-{step}-{i}" for i in range(len(beams))]
        searching.positions = {}
        try:
            for request_id, tokens in zip(searching.step_ids, beams, strict=True):
                self._engine.add_request(
                    request_id,
                    tokens,
                    searching.search.step_params,
                    lora_request=searching.prepared.lora_request,
                )
                self._by_request[request_id] = searching
        except Exception:
            self._engine.abort_request([i for i in searching.step_ids if self.owns(i)])
            for request_id in searching.step_ids:
                self._by_request.pop(request_id, None)
            raise
        return None

    def _results(self, searching: _Search[Line]) -> list[PromptResult]:
        outputs = searching.search.outputs(self._tokenizer)
        prompts = searching.prepared.prompts
        return [
            PromptResult.from_final_output(
                prompt,
                beam_request_output(
                    f"{searching.response_id}-{index}", prompt.text, prompt.token_ids, output
                ),
            )
            for index, (prompt, output) in enumerate(zip(prompts, outputs, strict=True))
        ]
