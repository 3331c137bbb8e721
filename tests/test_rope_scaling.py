"""RoPE scalings as transformers implements them: the frequencies, and whole models generating
across the lengths where the scalings act."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers_reference import (
    assert_prompt_logprobs_match,
    load_reference,
    ours_greedy,
    random_prompts,
    transformers_greedy,
)

from vacpack import LLM
from vacpack.models.model_config import ModelConfig
from vacpack.models.rotary import RotaryEmbedding, rope_inverse_frequencies
from vacpack.testing.tiny_models import TinyShape

ORIGINAL_CONTEXT = 32
ROTARY_PAIRS = 4  # a head of 16 dimensions, half of them rotating (partial_rotary_factor 0.5)
LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0, 1.3, 2.1, 3.5],
    "long_factor": [1.5, 2.8, 6.0, 11.0],
    "original_max_position_embeddings": ORIGINAL_CONTEXT,
}
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": ORIGINAL_CONTEXT,
    "beta_fast": 8,
    "beta_slow": 1,
}
YARN_WITH_MSCALE = {**YARN, "mscale": 0.9, "mscale_all_dim": 0.5}
DYNAMIC = {"rope_type": "dynamic", "factor": 4.0}


def _hf_config(model_type: str, rope: dict, **extra: object):
    fields = TinyShape().as_config_kwargs() | {"max_position_embeddings": 4 * ORIGINAL_CONTEXT}
    return AutoConfig.for_model(
        model_type,
        **fields | extra,
        vocab_size=64,
        architectures=["X"],
        rope_scaling=dict(rope),
    )


@pytest.mark.parametrize(
    ("model_type", "rope", "extra"),
    [
        ("llama", YARN, {}),
        ("llama", YARN_WITH_MSCALE, {}),
        ("llama", {"rope_type": "linear", "factor": 3.0}, {}),
        ("phi3", LONGROPE, {"partial_rotary_factor": 0.5}),
    ],
)
def test_frequencies_equal_transformers(model_type: str, rope: dict, extra: dict) -> None:
    hf_config = _hf_config(model_type, rope, **extra)
    settings = ModelConfig.from_hf(hf_config).rope
    init = ROPE_INIT_FUNCTIONS[rope["rope_type"]]
    for context_len in (ORIGINAL_CONTEXT, 4 * ORIGINAL_CONTEXT):
        # Longrope picks its long factors for a context past the original one.
        expected, expected_factor = init(hf_config, "cpu", seq_len=context_len)
        got, factor = rope_inverse_frequencies(settings, context_len)
        torch.testing.assert_close(got, expected, atol=0, rtol=0)
        assert factor == pytest.approx(expected_factor, rel=1e-12)


def test_dynamic_ntk_rotates_each_position_as_transformers_does_in_generation() -> None:
    """Position p past max_position_embeddings turns with the base of a p + 1 token sequence."""
    hf_config = _hf_config("llama", DYNAMIC, max_position_embeddings=ORIGINAL_CONTEXT)
    rotary = RotaryEmbedding(ModelConfig.from_hf(hf_config).rope)
    rotary.build_cache(torch.device("cpu"), torch.float32)
    assert rotary.cos_sin.shape[0] == 4 * ORIGINAL_CONTEXT
    init = ROPE_INIT_FUNCTIONS["dynamic"]
    for position in (0, ORIGINAL_CONTEXT - 1, ORIGINAL_CONTEXT, 3 * ORIGINAL_CONTEXT + 5):
        inv_freq, _ = init(hf_config, "cpu", seq_len=torch.tensor(position + 1))
        angles = position * inv_freq
        expected = torch.cat([angles.cos(), angles.sin()])
        torch.testing.assert_close(rotary.cos_sin[position], expected, atol=2e-6, rtol=0)


def _check_generation(model_dir, prompts: list[list[int]], max_new_tokens: int, **engine) -> None:
    llm = LLM(str(model_dir), dtype="float32", block_size=4, max_num_batched_tokens=24, **engine)
    reference = load_reference(model_dir)
    expected = transformers_greedy(reference, prompts, max_new_tokens)
    assert ours_greedy(llm, prompts, max_new_tokens) == expected
    assert_prompt_logprobs_match(llm, reference, prompts)


def test_yarn_model_past_its_original_context_equals_transformers(tiny_checkpoint) -> None:
    model_dir = tiny_checkpoint(
        "llama", rope_scaling=dict(YARN), max_position_embeddings=ORIGINAL_CONTEXT
    )
    _check_generation(model_dir, random_prompts([20, 45], 2048), 16)


def test_dynamic_ntk_decoding_past_max_positions_equals_transformers(tiny_checkpoint) -> None:
    model_dir = tiny_checkpoint(
        "llama", rope_scaling=dict(DYNAMIC), max_position_embeddings=ORIGINAL_CONTEXT
    )
    # Prompts within max_position_embeddings, decodes far past it.
    _check_generation(model_dir, random_prompts([9, 28], 2048), 24)


@pytest.mark.parametrize("long_context", [False, True])
def test_phi3_longrope_equals_transformers(long_context: bool, tiny_checkpoint) -> None:
    """Short factors while the engine's context stays within the original one; long factors
    for prompts past it, as transformers picks them for such a prompt."""
    model_dir = tiny_checkpoint(
        "phi3",
        rope_scaling=dict(LONGROPE),
        partial_rotary_factor=0.5,
        max_position_embeddings=4 * ORIGINAL_CONTEXT,
        original_max_position_embeddings=ORIGINAL_CONTEXT,
    )
    if long_context:
        _check_generation(model_dir, random_prompts([40, 70], 2048), 10)
    else:
        _check_generation(
            model_dir, random_prompts([7, 18], 2048), 12, max_model_len=ORIGINAL_CONTEXT
        )
