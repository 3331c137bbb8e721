"""`vacpack serve --tensor-parallel-size 2`, a real server process on this CPU: its answers are
one process's, and SIGTERM leaves no worker behind."""

from __future__ import annotations

import time

import httpx
import pytest
from process_table import children, is_running
from server_process import running_server, stop

from vacpack import LLM, SamplingParams

PROMPT = "the quick brown fox jumps over the lazy dog"
MAX_TOKENS = 5
TOLERANCE = 1e-5


def test_the_server_on_two_ranks_answers_as_one_process_and_stops_cleanly(tiny_checkpoint) -> None:
    model_dir = tiny_checkpoint("qwen2")
    # A given step and bin budget: no probe forwards to measure one.
    single = LLM(str(model_dir), dtype="float32", max_model_len=256, max_num_batched_tokens=64)
    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0, prompt_logprobs=0, ignore_eos=True
    )
    [expected] = single.generate([PROMPT], params, use_tqdm=False)
    [expected_vector] = single.embed([PROMPT], use_tqdm=False)
    with running_server(
        model_dir, "--tensor-parallel-size", "2", "--max-model-len", "256",
        "--kv-cache-memory-bytes", str(4 << 20), "--served-model-name", "tiny",
        "--max-num-batched-tokens", "64",
    ) as server:  # fmt: skip
        workers = children(server.process.pid)
        assert workers, "the server runs its second rank in a process of its own"
        request = {
            "model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
            "logprobs": 0, "echo": True, "ignore_eos": True,
        }  # fmt: skip
        completion = httpx.post(f"{server.api_url}/completions", json=request, timeout=60).json()
        embedding = httpx.post(
            f"{server.api_url}/embeddings", json={"model": "tiny", "input": [PROMPT]}, timeout=60
        ).json()
        stop(server)
        assert server.process.returncode == 0, server.log()

    [choice] = completion["choices"]
    assert choice["text"] == PROMPT + expected.outputs[0].text
    served_logprobs = choice["logprobs"]["token_logprobs"]
    prompt_ids = expected.prompt_token_ids
    expected_logprobs = [
        expected.prompt_logprobs[i][prompt_ids[i]].logprob for i in range(1, len(prompt_ids))
    ] + [
        entry[token].logprob
        for entry, token in zip(
            expected.outputs[0].logprobs, expected.outputs[0].token_ids, strict=True
        )
    ]
    assert served_logprobs[0] is None
    assert served_logprobs[1:] == pytest.approx(expected_logprobs, abs=TOLERANCE)
    served_vector = embedding["data"][0]["embedding"]
    assert served_vector == pytest.approx(expected_vector.outputs.embedding, abs=TOLERANCE)
    deadline = time.monotonic() + 10
    while any(is_running(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in workers if is_running(pid)], "a worker outlived the server"
