"""Prefix caching: same outputs with it on and off, shared prefixes computed once, no leaks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scheduler_helpers import add_sequence, finish, run_step

from vacpack import LLM, SamplingParams
from vacpack.engine.request import Sequence
from vacpack.engine.scheduler import Scheduler, SchedulerConfig
from vacpack.kvcache.page_pool import PagePool

PAGE_SIZE = 8


def _llm(model_dir, enable_prefix_caching: bool, **kwargs) -> LLM:
    return LLM(
        str(model_dir), dtype="float32", block_size=PAGE_SIZE, max_num_batched_tokens=48,
        enable_prefix_caching=enable_prefix_caching, **kwargs,
    )  # fmt: skip


def _shared_prefix_prompts(vocab_size: int, shared_len: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, vocab_size, (shared_len,), generator=generator).tolist()
    suffix_lens = [1, 3, 8, 9, 17, 30]  # partial pages, exact pages, several pages
    return [
        shared + torch.randint(0, vocab_size, (n,), generator=generator).tolist()
        for n in suffix_lens
    ]


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint):
    return tiny_checkpoint("qwen3")


@pytest.mark.parametrize("shared_len", [5, 16, 37])
def test_outputs_and_prompt_logprobs_equal_with_cache_on_and_off(model_dir, shared_len) -> None:
    on, off = _llm(model_dir, True), _llm(model_dir, False)
    prompts = _shared_prefix_prompts(on.loaded.config.vocab_size, shared_len, seed=shared_len)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    for llm in (on, off):  # warm the cache with the first prompt, then run them all
        llm.generate(prompts[:1], params, use_tqdm=False)
    cached = on.generate(prompts, params, use_tqdm=False)
    plain = off.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in cached] == [o.outputs[0].token_ids for o in plain]
    assert on.engine.page_pool.stats.num_hit_tokens >= (shared_len // PAGE_SIZE) * PAGE_SIZE * 5
    assert off.engine.page_pool.stats.num_hit_tokens == 0
    # Prompt logprobs need every position's logits: they never come from the cache.
    scored = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    a = on.generate(prompts, scored, use_tqdm=False)
    b = off.generate(prompts, scored, use_tqdm=False)
    for x, y in zip(a, b, strict=True):
        got = [next(iter(p.values())).logprob for p in x.prompt_logprobs[1:]]
        want = [next(iter(p.values())).logprob for p in y.prompt_logprobs[1:]]
        assert got == pytest.approx(want, abs=1e-5)


def test_a_shared_system_prompt_is_computed_once(model_dir) -> None:
    llm = _llm(model_dir, True)
    shared_len = 64
    prompts = _shared_prefix_prompts(llm.loaded.config.vocab_size, shared_len, seed=1)
    params = SamplingParams(temperature=0, max_tokens=1)
    llm.generate(prompts[:1], params, use_tqdm=False)
    before = llm.engine.stats.num_processed_tokens
    llm.generate(prompts[1:], params, use_tqdm=False)
    computed = llm.engine.stats.num_processed_tokens - before
    unique = sum(len(p) - shared_len for p in prompts[1:])
    assert computed == unique  # 64 shared tokens are 8 whole pages: nothing recomputed
    # Each output says how much of its prompt came from the cache (vLLM's num_cached_tokens).
    again = llm.generate(prompts, params, use_tqdm=False)
    assert [output.num_cached_tokens for output in again] == [
        (len(prompt) - 1) // PAGE_SIZE * PAGE_SIZE
        for prompt in prompts  # all but the last
    ]


def test_reset_prefix_cache_starts_cold_and_waits_for_unfinished_requests(model_dir) -> None:
    llm = _llm(model_dir, True)
    prompts = _shared_prefix_prompts(llm.loaded.config.vocab_size, 64, seed=2)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    first = llm.generate(prompts, params, use_tqdm=False)
    assert llm.reset_prefix_cache() is True
    llm.engine.page_pool.check_consistency()
    assert llm.engine.page_pool.num_free_pages == llm.engine.page_pool.num_pages
    again = llm.generate(prompts[:1], params, use_tqdm=False)
    assert again[0].num_cached_tokens == 0  # the prefix is computed again
    assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    # While a request is unfinished nothing is forgotten, as in vLLM.
    engine = llm.engine
    engine.add_request("pending", {"prompt_token_ids": prompts[1]}, params)
    engine.step()
    assert llm.reset_prefix_cache() is False
    while engine.has_unfinished_requests():
        engine.step()
    assert llm.reset_prefix_cache() is True
    llm.engine.page_pool.check_consistency()


def test_n_samples_compute_their_prompt_once(model_dir) -> None:
    llm = _llm(model_dir, True)
    prompt = list(range(100, 180))  # 80 tokens: 10 whole pages; the last token is recomputed
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=5, ignore_eos=True)
    (output,) = llm.generate([prompt], params, use_tqdm=False)
    assert len(output.outputs) == 4
    steps = llm.engine.timeline.steps
    prefill_tokens = sum(s.num_tokens - s.num_decode_tokens for s in steps)
    # One full prompt, then each other sample only the last page (recomputed for its logits).
    assert prefill_tokens <= len(prompt) + 3 * PAGE_SIZE
    off = _llm(model_dir, False)
    (plain,) = off.generate([prompt], params, use_tqdm=False)
    assert [c.token_ids for c in plain.outputs] == [c.token_ids for c in output.outputs]


def test_eviction_under_a_tiny_budget_keeps_outputs_and_leaks_nothing(model_dir) -> None:
    roomy = _llm(model_dir, True, max_model_len=160)
    prompts = _shared_prefix_prompts(roomy.loaded.config.vocab_size, 40, seed=4) * 2
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    bytes_per_token = roomy.engine.kv_cache.num_bytes // (
        roomy.engine.page_pool.num_pages * PAGE_SIZE
    )
    tight = _llm(model_dir, True, max_model_len=160, kv_cache_memory_bytes=200 * bytes_per_token)
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    pool = tight.engine.page_pool
    assert pool.stats.num_evictions > 0
    pool.check_consistency()
    assert pool.num_free_pages == pool.num_pages
    assert all(pool.ref_count(page) == 0 for page in range(pool.num_pages))


# ------------------------------------------------------------------ property test


operation = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 3), st.integers(1, 40)),  # prefix id, suffix length
    st.tuples(st.just("step"), st.just(0), st.just(0)),
    st.tuples(st.just("finish"), st.integers(0, 50), st.just(0)),
    st.tuples(st.just("abort"), st.integers(0, 50), st.just(0)),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(operation, min_size=1, max_size=60), st.integers(6, 40))
def test_random_add_step_finish_abort_keep_the_pool_consistent(ops, num_pages: int) -> None:
    pool = PagePool(num_pages, 4, enable_prefix_caching=True)
    scheduler = Scheduler(SchedulerConfig(4, 24, 4), pool)
    prefixes = [list(range(k * 100, k * 100 + 4 * (k + 1) + 1)) for k in range(4)]
    live: list[Sequence] = []
    for number, (kind, a, b) in enumerate(ops):
        if kind == "add":
            tokens = prefixes[a] + list(range(5000 + number, 5000 + number + b))
            if -(-(len(tokens) + 10) // 4) > num_pages:
                continue  # could never fit: an engine refuses a cache this small (test below)
            live.append(add_sequence(scheduler, str(number), tokens, max_tokens=50))
        elif kind == "step":
            run_step(scheduler, sampled_token_id=7 + number)
        elif live:
            finish(scheduler, live.pop(a % len(live)))
        pool.check_consistency()
    for sequence in live:
        finish(scheduler, sequence)
    pool.check_consistency()
    assert pool.num_free_pages == num_pages


def test_continuations_after_a_shared_context_compute_it_once(model_dir) -> None:
    words = ["rain", "hills", "quiet", "rivers", "over", "the", "warm", "mat"]
    context = " ".join(words[i % 8] for i in range(70))
    choices = [" rain fell", " over the hills", " mat", " the quiet rivers ran"]
    contexts = [context] * 4 + [context + " again"] * 4
    continuations = choices * 2
    cached = _llm(model_dir, True)
    results = cached.loglikelihood(contexts, continuations, use_tqdm=False)
    plain = _llm(model_dir, False).loglikelihood(contexts, continuations, use_tqdm=False)
    for a, b in zip(results, plain, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert (a.num_tokens, a.is_greedy) == (b.num_tokens, b.is_greedy)
    context_len = len(cached.get_tokenizer().encode(context, add_special_tokens=False))
    computed = cached.engine.stats.num_processed_tokens
    tokenizer = cached.get_tokenizer()
    pairs = zip(contexts, continuations, strict=True)
    total = sum(len(tokenizer.encode(c + x)) for c, x in pairs)
    # Each distinct context once (two of them, sharing most pages), the rest per continuation.
    assert computed < total - 5 * context_len


def test_a_cache_that_cannot_hold_one_whole_sequence_is_refused_up_front(model_dir) -> None:
    """Every request stops at max_model_len, so a cache holding one whole sequence can always
    finish each request by preempting the others; a smaller one is refused when the engine is
    built, with the limits named, instead of deadlocking later."""
    with pytest.raises(ValueError, match="fewer than one sequence of max_model_len=160"):
        _ = _llm(model_dir, True, max_model_len=160, kv_cache_memory_bytes=4096).engine
