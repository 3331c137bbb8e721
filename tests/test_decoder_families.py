"""Gemma 2, Gemma 3, Phi-3 and the mixtures of experts equal transformers: greedy tokens and
prompt logprobs, through the engine with chunked prefill and small pages."""

from __future__ import annotations

import pytest
from transformers_reference import (
    assert_prompt_logprobs_match,
    load_reference,
    ours_greedy,
    random_prompts,
    transformers_greedy,
)

from vacpack import LLM

# Gemma's windows (24 tokens) are shorter than most of these prompts.
FAMILIES = ["gemma2", "gemma3", "phi3", "mixtral", "qwen2_moe", "qwen3_moe"]
PROMPT_LENGTHS = [1, 17, 40, 90]
MAX_NEW_TOKENS = 8


@pytest.mark.parametrize("family", FAMILIES)
def test_family_equals_transformers(family: str, tiny_checkpoint) -> None:
    model_dir = tiny_checkpoint(family)
    llm = LLM(
        str(model_dir), dtype="float32", block_size=4, max_num_batched_tokens=48, max_num_seqs=6
    )
    prompts = random_prompts(PROMPT_LENGTHS, llm.loaded.config.vocab_size)
    reference = load_reference(model_dir)
    assert ours_greedy(llm, prompts, MAX_NEW_TOKENS) == transformers_greedy(
        reference, prompts, MAX_NEW_TOKENS
    )
    assert any(0 < s.num_decode_tokens < s.num_tokens for s in llm.engine.timeline.steps)
    assert_prompt_logprobs_match(llm, reference, prompts[1:3])


def test_unsupported_architecture_lists_the_supported_ones(tmp_path) -> None:
    from vacpack.models.registry import model_class_for

    with pytest.raises(ValueError, match="'FalconForCausalLM' is not supported") as error:
        model_class_for("FalconForCausalLM")
    for name in ("Gemma2ForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM", "LlamaForCausalLM"):
        assert name in str(error.value)
