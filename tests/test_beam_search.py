"""Beam search against the same search run on transformers' log-probabilities: the same
hypotheses, tokens and scores, with end-of-sequence tokens finishing some."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers_reference import load_reference, random_prompts

from vacpack import LLM, BeamSearchParams, SamplingParams
from vacpack.beam_search import beam_search_score

# Candidate orders closer than this may flip between two float32 computations of the logits:
# prompts whose search meets such a near tie are not compared.
MIN_DECISION_GAP = 2e-4


def reference_beam_search(
    model: torch.nn.Module,
    prompt: list[int],
    width: int,
    max_tokens: int,
    eos_ids: frozenset[int],
    length_penalty: float = 1.0,
) -> tuple[list[tuple[list[int], float]], float]:
    """The best (tokens, cumulative logprob) hypotheses by the rules beam_search.py documents,
    computed on transformers' logits, and the smallest score gap any of its decisions met."""
    gaps: list[float] = []

    def score(hypothesis: tuple[list[int], float]) -> float:
        tokens, cum_logprob = hypothesis
        length = len(tokens) - (tokens[-1] in eos_ids)  # a final end-of-sequence is not counted
        return cum_logprob / length**length_penalty

    def best(hypotheses: list[tuple[list[int], float]]) -> list[tuple[list[int], float]]:
        ranked = sorted(hypotheses, key=score, reverse=True)
        scores = [score(h) for h in ranked[: width + 1]]
        gaps.extend(a - b for a, b in itertools.pairwise(scores))
        return ranked[:width]

    live: list[tuple[list[int], float]] = [(prompt, 0.0)]
    finished: list[tuple[list[int], float]] = []
    for _ in range(max_tokens):
        growing = []
        for tokens, cum_logprob in live:
            with torch.no_grad():
                logits = model(torch.tensor([tokens])).logits[0, -1]
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            # The most likely first, equally likely in id order (a tie at the cut is a zero gap).
            likely = logprobs.topk(2 * width + 2).indices.tolist()
            top = sorted(likely, key=lambda t: (-float(logprobs[t]), t))[: 2 * width + 1]
            logprobs = {t: float(logprobs[t]) for t in top}
            gaps.extend(logprobs[a] - logprobs[b] for a, b in itertools.pairwise(top))
            for token_id in top[: 2 * width]:
                extended = ([*tokens, token_id], cum_logprob + logprobs[token_id])
                (finished if token_id in eos_ids else growing).append(extended)
        live = best(growing)
    return best(finished + live), min(gaps)


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("beam") / "model"
    shutil.copytree(tiny_checkpoint("llama"), directory)
    return directory


def _compare(llm: LLM, model: torch.nn.Module, params: BeamSearchParams, eos_ids: frozenset[int]):
    prompts = random_prompts([5, 9, 14, 20, 7, 11], llm.loaded.config.vocab_size, seed=4)
    compared = 0
    outputs = llm.beam_search(prompts, params)
    for prompt, output in zip(prompts, outputs, strict=True):
        expected, gap = reference_beam_search(
            model, prompt, params.beam_width, params.max_tokens, eos_ids, params.length_penalty
        )
        if gap < MIN_DECISION_GAP:
            continue
        compared += 1
        assert [s.tokens for s in output.sequences] == [tokens for tokens, _ in expected]
        for sequence, (_, cum_logprob) in zip(output.sequences, expected, strict=True):
            assert sequence.cum_logprob == pytest.approx(cum_logprob, abs=1e-4)
            assert len(sequence.logprobs) == len(sequence.tokens) - len(prompt)
    assert compared >= 2, "too few prompts without near ties to compare"
    return prompts, outputs


def test_beams_equal_the_same_search_on_transformers(model_dir: Path) -> None:
    llm = LLM(str(model_dir), dtype="float32", block_size=4)
    model = load_reference(model_dir)
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True, length_penalty=0.5)
    prompts, outputs = _compare(llm, model, params, frozenset())
    for output in outputs:
        assert len(output.sequences) == 3
        assert all(s.finish_reason == "length" for s in output.sequences)
    # Width one is greedy decoding; every KV page is back after a search.
    (single,) = llm.beam_search([prompts[0]], BeamSearchParams(beam_width=1, max_tokens=6))
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    (output,) = llm.generate([prompts[0]], greedy, use_tqdm=False)
    assert single.sequences[0].tokens[len(prompts[0]) :] == output.outputs[0].token_ids
    assert llm.engine.page_pool.num_free_pages == llm.engine.page_pool.num_pages


def test_an_end_of_sequence_token_finishes_a_hypothesis(model_dir: Path, tmp_path: Path) -> None:
    """The model's most likely first token is made its end-of-sequence token: extensions by it
    are finished hypotheses, competing with the live beams at the end."""
    model = load_reference(model_dir)
    first_prompt = random_prompts([5], model.config.vocab_size, seed=4)[0]
    with torch.no_grad():
        eos_id = int(model(torch.tensor([first_prompt])).logits[0, -1].argmax())
    eos_dir = tmp_path / "model"
    shutil.copytree(model_dir, eos_dir)
    config_path = eos_dir / "generation_config.json"
    config = json.loads(config_path.read_text())
    config["eos_token_id"] = eos_id
    config_path.write_text(json.dumps(config))
    llm = LLM(str(eos_dir), dtype="float32", block_size=4)
    assert eos_id in llm.loaded.eos_token_ids
    eos_ids = frozenset(llm.loaded.eos_token_ids)
    params = BeamSearchParams(beam_width=2, max_tokens=5)
    _, outputs = _compare(llm, model, params, eos_ids)
    stopped = [s for o in outputs for s in o.sequences if s.finish_reason == "stop"]
    assert stopped, "no hypothesis ended on the end-of-sequence token"
    tokenizer = llm.get_tokenizer()
    for sequence in stopped:
        assert sequence.tokens[-1] == sequence.stop_reason == eos_id
        generated = sequence.tokens[len(sequence.tokens) - len(sequence.logprobs) :]
        assert sequence.text == tokenizer.decode(generated[:-1], skip_special_tokens=True)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("beam_width", 0, "beam_width must be"),
        ("beam_width", 11, "beam_width must be"),
        ("max_tokens", 0, "max_tokens must be"),
        ("temperature", 0.7, "temperature must be 0"),
        ("length_penalty", float("nan"), "length_penalty must be finite"),
    ],
)
def test_impossible_parameters_are_refused(field: str, value: object, message: str) -> None:
    given = {"beam_width": 2, "max_tokens": 4, field: value}
    with pytest.raises(ValueError, match=message):
        BeamSearchParams(**given)  # type: ignore[arg-type]


def test_the_score_divides_by_the_length_without_a_final_end_of_sequence() -> None:
    eos = frozenset({0})
    assert beam_search_score([5, 6, 7, 0], -6.0, eos, 1.0) == pytest.approx(-2.0)
    assert beam_search_score([5, 6, 7, 8], -6.0, eos, 1.0) == pytest.approx(-1.5)
    assert beam_search_score([5, 6, 7, 8], -6.0, eos, 0.5) == pytest.approx(-3.0)
    assert beam_search_score([5, 6, 7, 8], -6.0, eos, 0.0) == pytest.approx(-6.0)
