"""Sliding-window models through the engine equal transformers: prompts longer than the window,
decodes that cross it, chunked prefill and the prefix cache on; and the KV pages behind every
layer's window go back to the pool while a sequence decodes."""

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

WINDOW = 24
MAX_NEW_TOKENS = 20  # every prompt's decode crosses the window
PAGE_SIZE = 4


def _prompts(vocab_size: int) -> list[list[int]]:
    """Prompts shorter and longer than the window; two share their first 48 tokens (12 pages)
    with an earlier one, so they start from the prefix cache."""
    short, medium, long = random_prompts([9, 37, 70], vocab_size)
    shared = random_prompts([20, 33], vocab_size, seed=1)
    return [short, medium, long, long[:48] + shared[0], long[:48] + shared[1]]


# Mistral: every layer windowed, so dead pages are freed. Qwen2: only the layers from
# max_window_layers on have the window (layer 1 here). Gemma 2: alternating, soft-capped.
WINDOWED = {
    "mistral": {"sliding_window": WINDOW},
    "qwen2": {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    "gemma2": {},
}


@pytest.mark.parametrize(
    ("family", "async_scheduling"),
    [("mistral", False), ("mistral", True), ("qwen2", False), ("gemma2", False)],
)
def test_windowed_model_equals_transformers(
    family: str, async_scheduling: bool, tiny_checkpoint
) -> None:
    model_dir = tiny_checkpoint(family, **WINDOWED[family])
    llm = LLM(
        str(model_dir),
        dtype="float32",
        block_size=PAGE_SIZE,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        enable_prefix_caching=True,
        async_scheduling=async_scheduling,
    )
    config = llm.engine.model_config
    assert WINDOW in config.sliding_windows
    prompts = _prompts(config.vocab_size)
    reference = load_reference(model_dir)
    # One at a time first, so that the later prompts find their prefix cached.
    ours = ours_greedy(llm, prompts[:3], MAX_NEW_TOKENS) + ours_greedy(
        llm, prompts[3:], MAX_NEW_TOKENS
    )
    assert ours == transformers_greedy(reference, prompts, MAX_NEW_TOKENS)
    assert llm.engine.page_pool.stats.num_hit_tokens >= 2 * 48
    assert_prompt_logprobs_match(llm, reference, prompts[1:3])
    pool = llm.engine.page_pool
    pool.check_consistency()
    assert pool.num_free_pages == pool.num_pages


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_pages_behind_the_window_are_freed_during_decode(
    enable_prefix_caching: bool, tiny_checkpoint
) -> None:
    """A 20-token prompt decoding 60 tokens holds about window / page_size pages, not all of
    its context's; the same model without a window holds every page to the end."""
    prompts = random_prompts([20], 2048, seed=3)
    peak_pages = {}
    for window in (WINDOW, None):
        llm = LLM(
            str(tiny_checkpoint("mistral", sliding_window=window)),
            dtype="float32",
            block_size=PAGE_SIZE,
            max_num_batched_tokens=16,
            enable_prefix_caching=enable_prefix_caching,
        )
        ours_greedy(llm, prompts, 60)
        peak_pages[window] = max(step.kv_pages_used for step in llm.engine.stats.steps)
        pool = llm.engine.page_pool
        pool.check_consistency()
        assert pool.num_free_pages == pool.num_pages
    assert peak_pages[None] == 80 // PAGE_SIZE
    # The window's pages, the page being filled, and one more that a step may run into.
    assert peak_pages[WINDOW] <= WINDOW // PAGE_SIZE + 2
