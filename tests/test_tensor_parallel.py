"""Tensor parallelism over two processes on this CPU (gloo, float32): the same tokens, prompt
logprobs, log-likelihoods and embeddings as one process; each rank holds about half the
weights; a worker that dies fails the call at once; no process outlives its model."""

from __future__ import annotations

import gc
import multiprocessing
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
from lora_adapters import make_adapter
from process_table import is_running

from vacpack import LLM, EngineArgs, LLMEngine, LoRARequest, SamplingParams
from vacpack.distributed.driver import TensorParallelError
from vacpack.errors import CorruptWeightsError
from vacpack.outputs import RequestOutput
from vacpack.testing.tiny_encoders import build_tiny_bert

TP_SIZE = 2
# Small pages and step budget: prompts are prefilled in chunks and steps mix decodes with them.
ENGINE = {"dtype": "float32", "block_size": 4, "max_num_batched_tokens": 32, "max_model_len": 256}
PROMPTS = [[5, 7, 9, 100, 200], list(range(10, 50)), [3] * 17, [1]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, prompt_logprobs=2)
TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello there!",
    # Longer than a bin: a LONG_DOCUMENT program, chunked through a KV cache on every rank.
    " ".join(str(n) for n in range(60)),
]
LOGPROB_TOLERANCE = 1e-5
# Each rank's share of the parameters: half of the sharded ones, plus the replicated norms
# (and, with one KV head, the replicated key and value projections).
MAX_RANK_SHARE = 0.55


def _assert_same_generations(ours: list[RequestOutput], expected: list[RequestOutput]) -> None:
    for output, reference in zip(ours, expected, strict=True):
        assert output.outputs[0].token_ids == reference.outputs[0].token_ids
        for position, token in enumerate(reference.prompt_token_ids[1:], start=1):
            candidates, reference_candidates = (
                output.prompt_logprobs[position],
                reference.prompt_logprobs[position],
            )
            assert candidates[token].logprob == pytest.approx(
                reference_candidates[token].logprob, abs=LOGPROB_TOLERANCE
            )
            top = {t for t, lp in reference_candidates.items() if lp.rank <= 2}
            assert top <= set(candidates)


def _wait_until_gone(pids: list[int], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(is_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in pids if is_running(pid)], "a worker outlived its model"


@pytest.mark.parametrize(
    ("family", "overrides", "engine_args"),
    [
        # QKV biases, and a vocabulary that does not split evenly: the last rank's rows are
        # padded. (Llama is Qwen2 without the biases.) Speculative decoding: every rank runs
        # the LM head over the rows that verify drafts.
        ("qwen2", {"vocab_size": 2051}, {"num_speculative_tokens": 3, "prompt_lookup_min": 1}),
        # One KV head, replicated on both ranks; async scheduling shares the sampled tokens.
        # bfloat16 matrices with float32 arithmetic: every rank keeps them as rank 0 does.
        (
            "qwen3",
            {"num_key_value_heads": 1},
            {"async_scheduling": True, "dtype": "bfloat16", "cpu_bf16_arithmetic": "float32"},
        ),
    ],
)
def test_two_ranks_generate_and_score_what_one_does(
    family: str, overrides: dict, engine_args: dict, tiny_checkpoint
) -> None:
    model_dir = str(tiny_checkpoint(family, **overrides))
    engine = {**ENGINE, **engine_args}
    single = LLM(model_dir, **{**engine, "async_scheduling": None})
    expected = single.generate(PROMPTS, GREEDY, use_tqdm=False)
    expected_scores = single.loglikelihood(TEXTS, return_token_logprobs=True, use_tqdm=False)
    with LLM(model_dir, **engine, tensor_parallel_size=TP_SIZE) as llm:
        assert llm.loaded.dtype_description == single.loaded.dtype_description
        assert llm.loaded.driver is not None
        worker_pids = llm.loaded.driver.worker_pids
        assert all(is_running(pid) for pid in worker_pids)
        _assert_same_generations(llm.generate(PROMPTS, GREEDY, use_tqdm=False), expected)
        if engine.get("num_speculative_tokens"):
            assert llm.engine.state().num_draft_tokens > 0
        # A corpus job: packed bins and LM-head passes as programs of their own.
        scores = llm.loglikelihood(TEXTS, return_token_logprobs=True, use_tqdm=False)
        for score, expected_score in zip(scores, expected_scores, strict=True):
            # Token by token: a document's sum adds up each token's rounding differences.
            assert score.token_logprobs == pytest.approx(
                expected_score.token_logprobs, abs=LOGPROB_TOLERANCE
            )
        # Each rank read only its slices from the files and holds about half the weights.
        full = single.loaded.load_stats
        assert len(llm.loaded.rank_load_stats) == TP_SIZE
        for stats in llm.loaded.rank_load_stats:
            assert stats.parameter_bytes <= MAX_RANK_SHARE * full.parameter_bytes
            assert stats.checkpoint_bytes_read <= MAX_RANK_SHARE * full.checkpoint_bytes_read
        # The timeline counts the time rank 0 spent in collectives.
        steps = llm.engine.timeline.steps
        assert steps
        assert all(step.collective_s is not None and step.collective_s > 0 for step in steps)
    _wait_until_gone(worker_pids)


def test_an_engine_from_engine_args_runs_two_ranks_and_stops_them(tiny_checkpoint) -> None:
    """vLLM's LLMEngine.from_engine_args with tensor parallelism: the caller's step loop drives
    both ranks; close() stops the other."""
    model_dir = str(tiny_checkpoint("qwen2"))
    params = SamplingParams(temperature=0.0, max_tokens=6)
    expected = LLM(model_dir, **ENGINE).generate(PROMPTS, params, use_tqdm=False)
    engine = LLMEngine.from_engine_args(
        EngineArgs(model=model_dir, **ENGINE, tensor_parallel_size=TP_SIZE)
    )
    assert engine.loaded.driver is not None
    worker_pids = engine.loaded.driver.worker_pids
    for index, prompt in enumerate(PROMPTS):
        engine.add_request(str(index), prompt, params)
    finished: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
    assert [finished[str(index)] for index in range(len(PROMPTS))] == [
        output.outputs[0].token_ids for output in expected
    ]
    engine.close()
    _wait_until_gone(worker_pids)


def test_two_ranks_run_lora_adapters_as_one_does(tiny_checkpoint, tmp_path: Path) -> None:
    """Each rank reads its slices of the adapters (column-parallel B rows, row-parallel A
    columns); adapters and the base model mixed in one batch give one process's tokens."""
    model_dir = tiny_checkpoint("qwen2")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapters = [
        LoRARequest(f"a{i}", i + 1, str(make_adapter(model_dir, tmp_path / f"a{i}", seed=i,
                    targets=targets, r=4, lora_alpha=8)))
        for i in range(2)
    ]  # fmt: skip
    assigned = [adapters[0], None, adapters[1], adapters[0]]
    params = SamplingParams(temperature=0.0, max_tokens=6)
    engine = {**ENGINE, "enable_lora": True}
    expected = LLM(str(model_dir), **engine).generate(
        PROMPTS, params, use_tqdm=False, lora_request=assigned
    )
    with LLM(str(model_dir), **engine, tensor_parallel_size=TP_SIZE) as llm:
        got = llm.generate(PROMPTS, params, use_tqdm=False, lora_request=assigned)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
        llm.engine.remove_adapter(2)  # the other rank drops it too, and the group goes on
        again = llm.generate(PROMPTS[:1], params, use_tqdm=False, lora_request=adapters[0])
        assert again[0].outputs[0].token_ids == expected[0].outputs[0].token_ids


def test_two_ranks_embed_what_one_does(tmp_path: Path) -> None:
    model_dir = str(build_tiny_bert(tmp_path / "bert"))
    texts = ["hello world", "a longer text about many things " * 6, "x", *TEXTS]
    engine = {"dtype": "float32", "max_num_batched_tokens": 64}  # bins of at most 64 tokens
    expected = LLM(model_dir, **engine).embed(texts, use_tqdm=False)
    llm = LLM(model_dir, **engine, tensor_parallel_size=TP_SIZE)
    assert llm.loaded.driver is not None
    worker_pids = llm.loaded.driver.worker_pids
    for output, reference in zip(llm.embed(texts, use_tqdm=False), expected, strict=True):
        assert output.outputs.embedding == pytest.approx(reference.outputs.embedding, abs=1e-5)
    del llm  # garbage-collected: its workers leave too
    gc.collect()
    _wait_until_gone(worker_pids)


def test_a_worker_killed_mid_generation_fails_the_call_in_bounded_time(tiny_checkpoint) -> None:
    llm = LLM(str(tiny_checkpoint("qwen2")), **ENGINE, tensor_parallel_size=TP_SIZE)
    assert llm.loaded.driver is not None
    (worker_pid,) = llm.loaded.driver.worker_pids
    timeline = llm.engine.timeline

    def kill_once_generating() -> None:
        while len(timeline.steps) < 3:
            time.sleep(0.005)
        os.kill(worker_pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_once_generating)
    killer.start()
    start_s = time.monotonic()
    long_generation = SamplingParams(max_tokens=200, ignore_eos=True)
    with pytest.raises(TensorParallelError, match=r"rank 1 \(pid \d+\) was killed by SIGKILL"):
        llm.generate(PROMPTS, long_generation, use_tqdm=False)
    assert time.monotonic() - start_s < 30
    killer.join()
    # The group is finished: a later call says so at once instead of hanging.
    with pytest.raises(TensorParallelError, match="must be loaded again"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    llm.close()
    _wait_until_gone([worker_pid])


def test_a_damaged_checkpoint_gives_the_typed_error_and_stops_the_workers(
    tiny_checkpoint, tmp_path: Path
) -> None:
    model_dir = tmp_path / "damaged"
    shutil.copytree(tiny_checkpoint("qwen2"), model_dir)
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(CorruptWeightsError, match="not valid safetensors"):
        LLM(str(model_dir), dtype="float32", tensor_parallel_size=TP_SIZE)
    _wait_until_gone([child.pid for child in multiprocessing.active_children()])


def test_a_model_that_cannot_split_is_refused_before_any_process_starts(tiny_checkpoint) -> None:
    model_dir = str(tiny_checkpoint("qwen2"))  # 4 attention heads, 2 KV heads
    with pytest.raises(ValueError, match=r"attention heads \(4\) is not divisible by tensor_par"):
        LLM(model_dir, dtype="float32", tensor_parallel_size=3)
