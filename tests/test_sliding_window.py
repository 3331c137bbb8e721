"""Sliding-window models through the engine equal transformers: prompts longer than the window,
decodes that cross it, chunked prefill and the prefix cache on; and the KV pages behind every
layer's window go back to the pool while a sequence decodes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from transformers_reference import (
    assert_prompt_logprobs_match,
    load_reference,
    ours_greedy,
    random_prompts,
    transformers_greedy,
)

from vacpack import LLM
from vacpack.engine.kv_setup import pages_one_sequence_holds
from vacpack.models.model_config import layer_sliding_windows

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
    [("mistral", True), ("qwen2", False), ("gemma2", False)],
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
    config = llm.loaded.config
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


def test_pages_behind_the_window_are_freed_during_decode(tiny_checkpoint) -> None:
    """A 20-token prompt decoding 60 tokens holds about window / page_size pages, not all of
    its context's, with the prefix cache on (pages go back once indexed) or off; the same model
    without a window holds every page to the end."""
    prompts = random_prompts([20], 2048, seed=3)
    peak_pages = {}
    for window, enable_prefix_caching in [(WINDOW, True), (WINDOW, False), (None, True)]:
        llm = LLM(
            str(tiny_checkpoint("mistral", sliding_window=window)),
            dtype="float32",
            block_size=PAGE_SIZE,
            max_num_batched_tokens=16,
            enable_prefix_caching=enable_prefix_caching,
        )
        ours_greedy(llm, prompts, 60)
        steps = llm.engine.timeline.steps
        peak_pages[window, enable_prefix_caching] = max(step.kv_pages_used for step in steps)
        pool = llm.engine.page_pool
        pool.check_consistency()
        assert pool.num_free_pages == pool.num_pages
    assert peak_pages[None, True] == 80 // PAGE_SIZE
    # The window's pages, the page being filled, and one more that a step may run into.
    assert peak_pages[WINDOW, True] <= WINDOW // PAGE_SIZE + 2
    assert peak_pages[WINDOW, False] <= WINDOW // PAGE_SIZE + 2


def test_a_windowed_model_runs_in_a_cache_sized_for_its_window(tiny_checkpoint) -> None:
    """Every layer windowed: a cache far smaller than one whole context, but holding the window
    and two steps' tokens, runs long sequences (preempting each other) to the same tokens as a
    large one, with async scheduling and the prefix cache on (the most a sequence holds); one
    page less is refused up front."""
    path = str(tiny_checkpoint("mistral", sliding_window=WINDOW))
    engine_args = {"dtype": "float32", "block_size": PAGE_SIZE, "max_num_batched_tokens": 16}
    large = LLM(path, **engine_args)
    bytes_per_page = large.engine.kv_cache.num_bytes // large.engine.page_pool.num_pages
    needed = pages_one_sequence_holds(large.loaded.max_model_len, PAGE_SIZE, WINDOW, 16)
    assert needed * 10 < large.loaded.max_model_len // PAGE_SIZE
    small = LLM(
        path,
        kv_cache_memory_bytes=needed * bytes_per_page,
        async_scheduling=True,
        enable_prefix_caching=True,
        **engine_args,
    )
    assert small.engine.page_pool.num_pages == needed
    prompts = random_prompts([70, 45, 30], large.loaded.config.vocab_size, seed=5)
    assert ours_greedy(small, prompts, 50) == ours_greedy(large, prompts, 50)
    assert small.engine.stats.num_preemptions > 0
    with pytest.raises(ValueError, match="fewer than one sequence"):
        _ = LLM(path, kv_cache_memory_bytes=(needed - 1) * bytes_per_page, **engine_args).engine


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"model_type": "mistral"}, (8, 8, 8, 8)),
        (
            {"model_type": "qwen2", "use_sliding_window": True, "max_window_layers": 2},
            (None, None, 8, 8),
        ),
        ({"model_type": "qwen2", "use_sliding_window": False, "max_window_layers": 2}, (None,) * 4),
        ({"model_type": "gemma2"}, (8, None, 8, None)),
        ({"model_type": "gemma3_text", "sliding_window_pattern": 3}, (8, 8, None, 8)),
        (
            {"model_type": "gemma2", "layer_types": ["full_attention", "sliding_attention"] * 2},
            (None, 8, None, 8),
        ),
    ],
)
def test_which_layers_slide(fields: dict, expected: tuple) -> None:
    """From layer_types where the config lists them (transformers 5), else by each family's
    rule as transformers 4 applied it."""
    config = SimpleNamespace(num_hidden_layers=4, sliding_window=8, **fields)
    assert layer_sliding_windows(config) == expected
