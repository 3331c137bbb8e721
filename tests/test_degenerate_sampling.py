"""Sampling values at the edges of float32 (those past it are refused by name: test_sampling),
and a mask that leaves a row nothing to sample: each row samples a token of the vocabulary,
and the requests sharing its steps finish as they would alone. Before, such a row sampled an
id past the vocabulary, which failed the next step for every request in it."""

from __future__ import annotations

import pytest
import torch

from vacpack import LLM, SamplingParams
from vacpack.engine.truncation import apply_top_k_top_p

PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def llm(tiny_checkpoint) -> LLM:
    return LLM(str(tiny_checkpoint("qwen2")), dtype="float32", max_model_len=256)


def _degenerate_params(eos: int) -> dict[str, SamplingParams]:
    return {
        # Rounds to a subnormal in float32: a seen token's positive logit / it overflows.
        "tiny repetition penalty": SamplingParams(
            temperature=0.5, repetition_penalty=1e-44, max_tokens=6, seed=0
        ),
        # inf after the temperature's division, with -inf logits (EOS held back) beside it.
        "huge temperature": SamplingParams(temperature=3e38, min_tokens=3, max_tokens=6, seed=0),
        # The mask allows EOS alone while min_tokens holds it back: nothing left to sample.
        "only a held-back stop token allowed": SamplingParams(
            temperature=1.0, allowed_token_ids=[eos], min_tokens=2, max_tokens=6, seed=0
        ),
        "greedy, only a held-back stop token allowed": SamplingParams(
            temperature=0, allowed_token_ids=[eos], min_tokens=2, max_tokens=6
        ),
    }


def test_degenerate_rows_sample_inside_the_vocabulary_and_spare_their_batch(llm: LLM) -> None:
    eos = min(llm.loaded.eos_token_ids)
    vocab_size = llm.loaded.config.vocab_size
    innocent = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    [alone] = llm.generate(PROMPT, innocent, use_tqdm=False)
    degenerate = _degenerate_params(eos)
    outputs = llm.generate(
        [PROMPT] * (len(degenerate) + 1), [innocent, *degenerate.values()], use_tqdm=False
    )
    assert outputs[0].outputs[0].token_ids == alone.outputs[0].token_ids
    for name, output in zip(degenerate, outputs[1:], strict=True):
        token_ids = output.outputs[0].token_ids
        assert token_ids and all(0 <= t < vocab_size for t in token_ids), name
    # With EOS the only token the mask allows, the request ends on it at once: short of
    # min_tokens, which it cannot meet, rather than on a token the mask forbids.
    for name in (
        "only a held-back stop token allowed",
        "greedy, only a held-back stop token allowed",
    ):
        output = outputs[1 + list(degenerate).index(name)].outputs[0]
        assert output.token_ids == [eos] and output.finish_reason == "stop", name


def test_a_top_p_below_float32s_range_keeps_the_likeliest_token() -> None:
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.0]])
    top_k = torch.tensor([4.0])
    tiny = torch.finfo(torch.float32).tiny  # what the sampler raises a smaller top_p to
    kept = apply_top_k_top_p(logits, top_k, torch.tensor([tiny]), [4], [1e-46])
    assert torch.isfinite(kept).tolist() == [[False, True, False, False]]
