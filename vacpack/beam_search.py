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
from vacpack.outputs import Logprob, PositionLogprobs, RequestOutputKind
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


def run_beam_search(
    engine: LLMEngine,
    prompts: list[list[int]],
    params: BeamSearchParams,
    use_tqdm: bool = False,
) -> list[BeamSearchOutput]:
    """The best beam_width hypotheses of each prompt (token ids, checked by the caller)."""
    eos_token_ids = frozenset() if params.ignore_eos else engine.loaded.eos_token_ids
    max_model_len = engine.loaded.max_model_len

    def score(beam: BeamSearchSequence) -> float:
        return beam_search_score(
            beam.tokens, beam.cum_logprob, eos_token_ids, params.length_penalty
        )

    live = [[BeamSearchSequence(list(prompt))] for prompt in prompts]
    finished: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    step_params = SamplingParams(
        temperature=0.0,
        max_tokens=1,
        ignore_eos=True,
        logprobs=CANDIDATES_PER_BEAM * params.beam_width,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
    request_ids = (f"beam-search-{index}" for index in itertools.count())
    tokenizer = engine.loaded.tokenizer
    for _ in tqdm(range(params.max_tokens), desc="beam search", unit="tok", disable=not use_tqdm):
        for prompt_beams, prompt_finished in zip(live, finished, strict=True):
            # A beam that fills the context ends there.
            full = [beam for beam in prompt_beams if len(beam.tokens) >= max_model_len]
            prompt_finished.extend(_finish(beam, "length") for beam in full)
            prompt_beams[:] = [beam for beam in prompt_beams if len(beam.tokens) < max_model_len]
        candidates = _next_token_candidates(engine, live, step_params, request_ids)
        for index, extensions in enumerate(candidates):
            growing = []
            for beam in extensions:
                if beam.tokens[-1] in eos_token_ids:
                    finished[index].append(_finish(beam, "stop", beam.tokens[-1]))
                else:
                    growing.append(beam)
            live[index] = sorted(growing, key=score, reverse=True)[: params.beam_width]
        if not any(live):
            break
    outputs = []
    for prompt, prompt_beams, prompt_finished in zip(prompts, live, finished, strict=True):
        hypotheses = prompt_finished + [_finish(beam, "length") for beam in prompt_beams]
        best = sorted(hypotheses, key=score, reverse=True)[: params.beam_width]
        for beam in best:
            beam.text = _text(tokenizer, beam, len(prompt), params.include_stop_str_in_output)
        outputs.append(BeamSearchOutput(best))
    return outputs


def _next_token_candidates(
    engine: LLMEngine,
    live: list[list[BeamSearchSequence]],
    step_params: SamplingParams,
    request_ids: Iterator[str],
) -> list[list[BeamSearchSequence]]:
    """Every live beam extended by each of its most likely next tokens, per prompt."""
    num_candidates = step_params.logprobs or 1
    beams_by_request: dict[str, tuple[int, BeamSearchSequence]] = {}
    candidates: list[list[BeamSearchSequence]] = [[] for _ in live]
    try:
        for index, prompt_beams in enumerate(live):
            for beam in prompt_beams:
                request_id = next(request_ids)
                beams_by_request[request_id] = (index, beam)
                engine.add_request(request_id, beam.tokens, step_params)
        while engine.has_unfinished_requests():
            for output in engine.step():
                if not output.finished:
                    continue
                index, beam = beams_by_request[output.request_id]
                (position,) = output.outputs[0].logprobs or [{}]
                # Most likely first; equally likely tokens in id order, so the order is stable.
                ranked = sorted(position.items(), key=lambda item: (-item[1].logprob, item[0]))
                candidates[index].extend(
                    _extend(beam, token_id, logprob, position)
                    for token_id, logprob in ranked[:num_candidates]
                )
    finally:
        for request_id in beams_by_request:  # after an interruption, leave nothing running
            engine.abort_request(request_id)
    return candidates


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
