"""Async scheduling: the host prepares step N+1 while step N computes, and nothing changes.

On a CPU the "device" is a worker thread (ThreadExecutor), so these tests run the real overlapped
loop: step N+1 is launched before step N's tokens are read, requests that stop at step N are
already in step N+1, preempted requests may hold a token still being sampled. Where a GPU is
present they run on it too, where the device is a CUDA stream (CudaStreamExecutor).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from vacpack import LLM, SamplingParams
from vacpack.engine.step_executor import CudaStreamExecutor, InlineExecutor, ThreadExecutor

PAGE_SIZE = 4
DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
    ),
]


def _llm(model_dir, device: str, async_scheduling: bool, **kwargs) -> LLM:
    return LLM(
        str(model_dir), dtype="float32", device=device, block_size=PAGE_SIZE,
        max_num_batched_tokens=32, max_num_seqs=8, async_scheduling=async_scheduling, **kwargs,
    )  # fmt: skip


def _prompts(vocab_size: int, lengths: list[int], seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def _outputs(llm: LLM, prompts, params) -> list:
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [
        [
            (c.token_ids, c.text, c.finish_reason, c.stop_reason, _logprobs(c.logprobs))
            for c in o.outputs
        ]
        + [_logprobs(o.prompt_logprobs)]
        for o in outputs
    ]


def _logprobs(positions) -> list | None:
    if positions is None:
        return None
    return [
        None if p is None else sorted((t, round(lp.logprob, 4)) for t, lp in p.items())
        for p in positions
    ]


def _assert_no_leaks(llm: LLM) -> None:
    pool = llm.engine.page_pool
    pool.check_consistency()
    assert pool.num_free_pages == pool.num_pages
    assert not llm.engine.scheduler.running and not llm.engine.scheduler.waiting


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint):
    return tiny_checkpoint("qwen3")


@pytest.fixture(scope="module", params=DEVICES)
def device(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def engines(model_dir, device):
    sync, overlapped = _llm(model_dir, device, False), _llm(model_dir, device, True)
    assert not sync.engine.async_scheduling and overlapped.engine.async_scheduling
    if device == "cuda":
        assert isinstance(sync.engine.executor, CudaStreamExecutor)
        assert isinstance(overlapped.engine.executor, CudaStreamExecutor)
    else:
        assert isinstance(sync.engine.executor, InlineExecutor)
        assert isinstance(overlapped.engine.executor, ThreadExecutor)
    return sync, overlapped


def test_the_engine_really_overlaps(engines) -> None:
    """Step N+1 is launched before step N's results are read."""
    _, overlapped = engines
    vocab_size = overlapped.loaded.config.vocab_size
    prompts = _prompts(vocab_size, [5, 9, 13, 30], seed=0)
    overlapped.engine.timeline.reset()
    overlapped.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)
    steps = overlapped.engine.timeline.steps
    assert len(steps) > 12
    overlapping = [(a, b) for a, b in itertools.pairwise(steps) if b.launch_s < a.process_start_s]
    assert len(overlapping) >= len(steps) // 2
    for step in steps:
        assert step.prepare_start_s <= step.launch_s <= step.device_start_s
        assert step.device_start_s <= step.device_end_s <= step.process_start_s
    _assert_no_leaks(overlapped)


def test_greedy_outputs_identical_with_overlap_on_and_off(engines) -> None:
    sync, overlapped = engines
    vocab_size = sync.loaded.config.vocab_size
    prompts = _prompts(vocab_size, [1, 3, 4, 5, 8, 17, 31, 40, 2, 12, 64, 6], seed=1)
    params = SamplingParams(temperature=0, max_tokens=11, ignore_eos=True)
    assert _outputs(overlapped, prompts, params) == _outputs(sync, prompts, params)
    _assert_no_leaks(overlapped)


def test_requests_that_stop_while_already_scheduled(engines) -> None:
    """A stop token or stop string found at step N, when the request is already in step N+1:
    the output ends where the synchronous engine ends it, and its pages come back."""
    sync, overlapped = engines
    vocab_size = sync.loaded.config.vocab_size
    prompts = _prompts(vocab_size, [7, 11, 20, 3], seed=2)
    free_run = sync.generate(
        prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )
    for output in free_run:
        tokens, text = output.outputs[0].token_ids, output.outputs[0].text
        by_token = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[tokens[4]])
        stop_text = text[len(text) // 2 : len(text) // 2 + 2]
        by_string = SamplingParams(
            temperature=0, max_tokens=12, stop=[stop_text] if stop_text else None
        )
        for params in (by_token, by_string):
            got = _outputs(overlapped, [output.prompt_token_ids], params)
            want = _outputs(sync, [output.prompt_token_ids], params)
            assert got == want
            assert want[0][0][2] == "stop" or params is by_string
    _assert_no_leaks(overlapped)


def test_sampling_controls_identical_with_overlap_on_and_off(engines) -> None:
    """Seeded sampling, n > 1, min_tokens, logprobs, prompt logprobs and penalties (which make
    the engine read the running step first) give the same results."""
    sync, overlapped = engines
    vocab_size = sync.loaded.config.vocab_size
    prompts = _prompts(vocab_size, [6, 13, 25], seed=3)
    cases = [
        SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=9, n=2),
        SamplingParams(temperature=0, max_tokens=6, min_tokens=4, logprobs=3, prompt_logprobs=2),
        SamplingParams(temperature=0.8, seed=3, max_tokens=8, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=7, frequency_penalty=0.5, presence_penalty=0.3),
        SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=1),
    ]
    for params in cases:
        assert _outputs(overlapped, prompts, params) == _outputs(sync, prompts, params), params
    _assert_no_leaks(overlapped)


def test_a_prompt_only_request_launches_no_empty_step(engines, monkeypatch) -> None:
    """max_tokens 0: once its last prompt chunk is in flight there is nothing left to compute,
    and no step may be launched for it (an empty forward, a zero-length row for attention)."""
    _, overlapped = engines
    engine = overlapped.engine
    chunk_sizes: list[list[int]] = []
    prepare = engine.runner.prepare

    def recording_prepare(chunks):
        chunk_sizes.append([chunk.num_new_tokens for chunk in chunks])
        return prepare(chunks)

    monkeypatch.setattr(engine.runner, "prepare", recording_prepare)
    prompt = _prompts(overlapped.loaded.config.vocab_size, [70], seed=5)
    [output] = overlapped.generate(
        prompt, SamplingParams(max_tokens=0, prompt_logprobs=0), use_tqdm=False
    )
    assert len(output.prompt_logprobs) == 70
    assert chunk_sizes == [[32], [32], [6]]  # the 32-token budget's chunks, nothing after
    _assert_no_leaks(overlapped)


def test_preemption_with_tokens_in_flight(model_dir, device) -> None:
    """A tiny KV cache forces preemptions of requests whose last token is still being sampled;
    outputs stay those of a roomy synchronous engine and nothing leaks."""
    roomy = _llm(model_dir, device, False)
    vocab_size = roomy.loaded.config.vocab_size
    prompts = _prompts(vocab_size, [9, 14, 21, 30, 5, 17, 26, 11], seed=4)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = _outputs(roomy, prompts, params)
    bytes_per_token = roomy.engine.kv_cache.num_bytes // (
        roomy.engine.kv_cache.num_pages * PAGE_SIZE
    )
    tight = _llm(
        model_dir, device, True, max_model_len=64, kv_cache_memory_bytes=72 * bytes_per_token
    )
    assert _outputs(tight, prompts, params) == expected
    assert tight.engine.stats.num_preemptions > 0
    _assert_no_leaks(tight)


def test_abort_while_a_step_is_in_flight(engines) -> None:
    sync, overlapped = engines
    engine = overlapped.engine
    vocab_size = sync.loaded.config.vocab_size
    prompts = _prompts(vocab_size, [8, 15, 23], seed=5)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    expected = _outputs(sync, prompts, params)
    for index, prompt in enumerate(prompts):
        engine.add_request(f"r{index}", prompt, params)
    finished = {}
    num_steps = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        num_steps += 1
        if num_steps == 3:
            assert engine._in_flight is not None  # r1 is in the step on the device now
            engine.abort_request("r1")
    assert sorted(finished) == ["r0", "r2"]
    for name in ("r0", "r2"):
        index = int(name[1:])
        assert finished[name].outputs[0].token_ids == expected[index][0][0]
    _assert_no_leaks(overlapped)
