"""Beam search over the engine, with vLLM's `LLM.beam_search` names, parameters and scoring.

Each step asks the engine for one token of every live beam, with the 2 x beam_width most likely
next tokens and their log-probabilities. Every beam's extensions by those tokens compete, across
the beams of a prompt, on cumulative log-probability divided by length ** length_penalty (the
length counts the prompt, and not a final end-of-sequence token, as vLLM counts it); the best
beam_width go on. An extension by an end-of-sequence token is a finished hypothesis. After
max_tokens steps (or once no beam is left), the finished hypotheses and the live beams compete
on the same score, and the best beam_width are the output.

The beams of a prompt share every token but their last few, so with prefix caching (on by
default) a step computes little more than one new token per beam: the engine finds the rest of
each beam's tokens in its cache.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from vacpack.engine.engine import LLMEngine
from vacpack.lora.request import LoRARequest
from vacpack.outputs import (
    CompletionOutput,
    Logprob,
    PositionLogprobs,
    RequestOutput,
    RequestOutputKind,
)
from vacpack.sampling import MAX_LOGPROBS, SamplingParams

# Candidates asked for per beam and step, per unit of beam width: as many again as the beam
# width, so that beam_width live beams remain even if end-of-sequence tokens finish some.
CANDIDATES_PER_BEAM = 2


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams. Beams are scored on the model's own log-probabilities, so the
    only temperature is 0."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        max_width = MAX_LOGPROBS // CANDIDATES_PER_BEAM
        if not (isinstance(self.beam_width, int) and 1 <= self.beam_width <= max_width):
            raise ValueError(
                f"beam_width must be an int in [1, {max_width}], got {self.beam_width!r}"
            )
        if not (isinstance(self.max_tokens, int) and self.max_tokens >= 1):
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if self.temperature != 0:
            raise ValueError(
                "temperature must be 0 for beam search: beams are scored on the model's own "
                f"log-probabilities, got {self.temperature!r}"
            )
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be finite, got {self.length_penalty!r}")


@dataclass
class BeamSearchSequence:
    """One hypothesis: `tokens` holds the prompt's tokens, then the generated ones."""

    tokens: list[int]
    logprobs: list[PositionLogprobs] = field(default_factory=list)  # per generated token
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (end of sequence) or "length"
    stop_reason: int | None = None  # the end-of-sequence token that finished it


@dataclass
class BeamSearchOutput:
    """A prompt's best hypotheses, best first (at most beam_width)."""

    sequences: list[BeamSearchSequence]


def beam_search_score(
    tokens: Sequence[int],
    cum_logprob: float,
    eos_token_ids: AbstractSet[int],
    length_penalty: float,
) -> float:
    """Cumulative log-probability over length ** length_penalty; the length counts the prompt
    and not a final end-of-sequence token (vLLM's scoring)."""
    length = len(tokens) - (1 if tokens and tokens[-1] in eos_token_ids else 0)
    return cum_logprob / (length**length_penalty)


class BeamSearch:
    """One search over several prompts, driven a step at a time by whoever runs the engine
    (`run_beam_search` on the engine here, the server on its engine thread): each step, every
    beam in `beams_to_extend()` needs its next-token log-probabilities (an engine request with
    `step_params`), handed back in the same order to `advance`."""

    def __init__(
        self,
        prompts: list[list[int]],
        params: BeamSearchParams,
        eos_token_ids: AbstractSet[int],
        max_model_len: int,
    ) -> None:
        self.prompts = prompts
        self.params = params
        self.eos_token_ids = frozenset() if params.ignore_eos else eos_token_ids
        self.max_model_len = max_model_len
        self.step_params = SamplingParams(
            temperature=0.0,
            max_tokens=1,
            ignore_eos=True,
            logprobs=CANDIDATES_PER_BEAM * params.beam_width,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        self._live = [[BeamSearchSequence(list(prompt))] for prompt in prompts]
        self._finished: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        self._num_steps = 0
        self._extending: list[tuple[int, BeamSearchSequence]] = []

    def _score(self, beam: BeamSearchSequence) -> float:
        return beam_search_score(
            beam.tokens, beam.cum_logprob, self.eos_token_ids, self.params.length_penalty
        )

    def beams_to_extend(self) -> list[list[int]]:
        """The live beams' tokens, every prompt's in turn; none once the search is over."""
        if self._num_steps == self.params.max_tokens:
            return []
        self._extending = []
        for index, (beams, finished) in enumerate(zip(self._live, self._finished, strict=True)):
            # A beam that fills the context ends there.
            full = [beam for beam in beams if len(beam.tokens) >= self.max_model_len]
            finished.extend(_finish(beam, "length") for beam in full)
            beams[:] = [beam for beam in beams if len(beam.tokens) < self.max_model_len]
            self._extending.extend((index, beam) for beam in beams)
        return [beam.tokens for _, beam in self._extending]

    @property
    def extending_prompts(self) -> list[int]:
        """The prompt index of each beam `beams_to_extend` returned last."""
        return [index for index, _ in self._extending]

    def advance(self, positions: Sequence[PositionLogprobs]) -> None:
        """Each extended beam's next-token log-probabilities (`beams_to_extend`' order)."""
        num_candidates = self.step_params.logprobs or 1
        candidates: list[list[BeamSearchSequence]] = [[] for _ in self.prompts]
        for (index, beam), position in zip(self._extending, positions, strict=True):
            # Most likely first; equally likely tokens in id order, so the order is stable.
            ranked = sorted(position.items(), key=lambda item: (-item[1].logprob, item[0]))
            candidates[index].extend(
                _extend(beam, token_id, logprob, position)
                for token_id, logprob in ranked[:num_candidates]
            )
        for index, extensions in enumerate(candidates):
            growing = []
            for beam in extensions:
                if beam.tokens[-1] in self.eos_token_ids:
                    self._finished[index].append(_finish(beam, "stop", beam.tokens[-1]))
                else:
                    growing.append(beam)
            self._live[index] = sorted(growing, key=self._score, reverse=True)[
                : self.params.beam_width
            ]
        self._num_steps += 1
        if not any(self._live):
            self._num_steps = self.params.max_tokens

    def outputs(self, tokenizer: PreTrainedTokenizerBase) -> list[BeamSearchOutput]:
        """Each prompt's best hypotheses among the finished and the live ones, with text."""
        outputs = []
        for prompt, beams, finished in zip(self.prompts, self._live, self._finished, strict=True):
            hypotheses = finished + [_finish(beam, "length") for beam in beams]
            best = sorted(hypotheses, key=self._score, reverse=True)[: self.params.beam_width]
            for beam in best:
                beam.text = _text(
                    tokenizer, beam, len(prompt), self.params.include_stop_str_in_output
                )
            outputs.append(BeamSearchOutput(best))
        return outputs


def run_beam_search(
    engine: LLMEngine,
    prompts: list[list[int]],
    params: BeamSearchParams,
    use_tqdm: bool = False,
    adapters: Sequence[LoRARequest | None] | None = None,
) -> list[BeamSearchOutput]:
    """The best beam_width hypotheses of each prompt (token ids, checked by the caller), each
    prompt's beams run with its LoRA adapter in `adapters` (None: the base model)."""
    search = BeamSearch(prompts, params, engine.loaded.eos_token_ids, engine.loaded.max_model_len)
    request_ids = (f"beam-search-{index}" for index in itertools.count())
    with tqdm(total=params.max_tokens, desc="beam search", unit="tok", disable=not use_tqdm) as bar:
        while beams := search.beams_to_extend():
            beam_adapters = [adapters[i] if adapters else None for i in search.extending_prompts]
            positions = _next_token_positions(
                engine, beams, beam_adapters, search.step_params, request_ids
            )
            search.advance(positions)
            bar.update(1)
    return search.outputs(engine.loaded.tokenizer)


def _next_token_positions(
    engine: LLMEngine,
    beams: list[list[int]],
    adapters: list[LoRARequest | None],
    step_params: SamplingParams,
    request_ids: Iterator[str],
) -> list[PositionLogprobs]:
    """Each beam's most likely next tokens and their log-probabilities, in the beams' order."""
    order = {next(request_ids): index for index in range(len(beams))}
    positions: list[PositionLogprobs] = [{} for _ in beams]
    try:
        for request_id, index in order.items():
            engine.add_request(request_id, beams[index], step_params, lora_request=adapters[index])
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    (positions[order[output.request_id]],) = output.outputs[0].logprobs or [{}]
    finally:
        engine.abort_request(order)  # after an interruption, leave nothing running
    return positions


def beam_request_output(
    request_id: str, prompt_text: str | None, prompt_token_ids: list[int], output: BeamSearchOutput
) -> RequestOutput:
    """A prompt's hypotheses as a finished RequestOutput, one completion per hypothesis."""
    completions = [
        CompletionOutput(
            index=index,
            text=beam.text or "",
            token_ids=beam.tokens[len(prompt_token_ids) :],
            cumulative_logprob=beam.cum_logprob,
            logprobs=beam.logprobs,
            finish_reason=beam.finish_reason,
            stop_reason=beam.stop_reason,
        )
        for index, beam in enumerate(output.sequences)
    ]
    return RequestOutput(request_id, prompt_text, prompt_token_ids, None, completions, True)


def _extend(
    beam: BeamSearchSequence, token_id: int, logprob: Logprob, position: PositionLogprobs
) -> BeamSearchSequence:
    return BeamSearchSequence(
        tokens=[*beam.tokens, token_id],
        logprobs=[*beam.logprobs, position],
        cum_logprob=beam.cum_logprob + logprob.logprob,
    )


def _finish(
    beam: BeamSearchSequence, reason: str, stop_reason: int | None = None
) -> BeamSearchSequence:
    beam.finish_reason, beam.stop_reason = reason, stop_reason
    return beam


def _text(
    tokenizer: PreTrainedTokenizerBase,
    beam: BeamSearchSequence,
    prompt_length: int,
    include_stop_str_in_output: bool,
) -> str:
    generated = beam.tokens[prompt_length:]
    if beam.finish_reason == "stop" and not include_stop_str_in_output:
        generated = generated[:-1]
    return tokenizer.decode(generated, skip_special_tokens=True)
