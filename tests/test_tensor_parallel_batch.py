"""`vacpack run-batch --tensor-parallel-size 2`, a real process on this CPU: its records are one
process's records, and Ctrl-C mid-run ends it and its worker."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from process_table import children, is_running

from vacpack import LLM
from vacpack.batch.options import BatchOptions
from vacpack.batch.runner import run_batch

# A given bin budget (no probe forwards to measure one), a small KV cache.
ENGINE_FLAGS = {
    "dtype": "float32",
    "max_model_len": 256,
    "kv_cache_memory_bytes": 4 << 20,
    "max_num_batched_tokens": 64,
}
TOLERANCE = 1e-5


def _line(custom_id: str, url: str, body: dict[str, Any]) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _lines() -> list[str]:
    completion = {"max_tokens": 4, "temperature": 0, "logprobs": 1, "ignore_eos": True}
    messages = [{"role": "user", "content": "hi there"}]
    chat = {"messages": messages, "max_tokens": 3, "temperature": 0}
    return [
        _line("c1", "/v1/completions", {"prompt": "hello world", **completion}),
        _line("c2", "/v1/completions", {"prompt": "the quick brown fox jumps", **completion}),
        _line("chat", "/v1/chat/completions", chat),
        _line("e", "/v1/embeddings", {"input": ["hello world", "a second text"]}),
    ]


def _command(model_dir: Path, input_path: Path, output_path: Path) -> list[str]:
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in ENGINE_FLAGS.items()]
    return [
        sys.executable, "-m", "vacpack", "run-batch", "--model", str(model_dir), *flags,
        "--tensor-parallel-size", "2", "-i", str(input_path), "-o", str(output_path), "--quiet",
    ]  # fmt: skip


def _bodies(path: Path) -> dict[str, dict[str, Any]]:
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    return {record["custom_id"]: record["response"]["body"] for record in records}


def test_run_batch_on_two_ranks_writes_what_one_process_writes(
    tiny_checkpoint, tmp_path: Path
) -> None:
    model_dir = tiny_checkpoint("qwen2")
    input_path = tmp_path / "in.jsonl"
    input_path.write_text("".join(line + "\n" for line in _lines()), encoding="utf-8")
    expected_path = tmp_path / "one.jsonl"
    run_batch(
        LLM(str(model_dir), **ENGINE_FLAGS),
        BatchOptions(input_path, expected_path, show_progress=False),
    )
    output_path = tmp_path / "two.jsonl"
    run = subprocess.run(
        _command(model_dir, input_path, output_path), capture_output=True, timeout=120
    )
    assert run.returncode == 0, run.stderr.decode()

    ours, expected = _bodies(output_path), _bodies(expected_path)
    assert sorted(ours) == sorted(expected) == ["c1", "c2", "chat", "e"]
    for custom_id in ("c1", "c2"):
        [choice], [expected_choice] = ours[custom_id]["choices"], expected[custom_id]["choices"]
        assert choice["text"] == expected_choice["text"]
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(
            expected_choice["logprobs"]["token_logprobs"], abs=TOLERANCE
        )
    assert ours["chat"]["choices"][0]["message"] == expected["chat"]["choices"][0]["message"]
    for item, expected_item in zip(ours["e"]["data"], expected["e"]["data"], strict=True):
        assert item["embedding"] == pytest.approx(expected_item["embedding"], abs=TOLERANCE)


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_mid_run_ends_run_batch_and_its_worker(tiny_checkpoint, tmp_path: Path) -> None:
    # The first answer is written early; the others keep the ranks generating.
    lines = [_line("short", "/v1/completions", {"prompt": "hello", "max_tokens": 2})]
    long_completion = {"prompt": "hello", "max_tokens": 200, "ignore_eos": True}
    lines += [_line(f"k{i}", "/v1/completions", long_completion) for i in range(64)]
    input_path = tmp_path / "in.jsonl"
    input_path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    output_path = tmp_path / "out.jsonl"
    command = _command(tiny_checkpoint("qwen2"), input_path, output_path)
    process = subprocess.Popen(
        command,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        # A child inherits an ignored SIGINT (an earlier test in this process may have left it
        # ignored), and Python then never turns Ctrl-C into KeyboardInterrupt: as from a shell.
        preexec_fn=_default_sigint,
    )
    try:
        deadline = time.monotonic() + 60
        workers: list[int] = []
        # Once the worker runs and the first answers are written, the run is mid-generation.
        while time.monotonic() < deadline and process.poll() is None:
            workers = workers or children(process.pid)
            if workers and output_path.exists() and output_path.stat().st_size > 0:
                break
            time.sleep(0.02)
        assert process.poll() is None, "the run ended before it could be interrupted"
        assert workers, "run-batch runs its second rank in a process of its own"
        process.send_signal(signal.SIGINT)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode != 0
    deadline = time.monotonic() + 10
    while any(is_running(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in workers if is_running(pid)], "a worker outlived run-batch"
