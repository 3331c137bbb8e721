"""Runs killed with SIGKILL at random points, and runs that fill the disk, then resumed.

However a run of `run-batch` or `generate --input/--output` ends, rerunning it with the same
output answers every request exactly once, the output never holds a torn line, and a user's
file beside it is never touched. The commands run as real processes (forked from a zygote with
vacpack imported, so that a dozen restarts take seconds) on a tiny float32 model.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from bad_input_files import batch_line, completion_line, read_records, write_lines
from cli_zygote import Finished, Zygote

from vacpack.errors import ExitCode

NUM_REQUESTS = 48
# A kill lands before this many records are left, so no run ends before its kills.
MIN_RECORDS_LEFT = 12
KILLS_PER_COMMAND = 5
ENGINE_FLAGS = [
    "--dtype", "float32", "--max-model-len", "128", "--kv-cache-memory-bytes", str(2 << 20),
    "--max-num-seqs", "4", "--quiet",
]  # fmt: skip
# Long enough that the results of every job overflow a 4 KiB page (see _disk).
PROMPT_TEXT = "the quick brown fox jumps over the lazy dog " * 2
# oneDNN's first calls per shape cost more than this tiny model's whole run.
CHILD_ENV = {"VACPACK_CPU_PREPACK": "0"}


@dataclass(frozen=True)
class Job:
    name: str
    argv: list[str]
    output: Path
    expected_keys: frozenset[Any]  # what identifies each request's record
    key: Callable[[dict[str, Any]], Any]

    def check_answered_exactly_once(self) -> None:
        keys = [self.key(record) for record in read_records(self.output)]
        assert len(keys) == len(set(keys)), f"{self.name}: a request was answered twice"
        assert set(keys) == self.expected_keys, f"{self.name}: requests missing"


def _batch_job(model: Path, directory: Path, output_dir: Path | None = None) -> Job:
    lines = [
        completion_line(f"r{i}", max_tokens=2 + i % 3, ignore_eos=True, temperature=1.0)
        for i in range(NUM_REQUESTS - 3)
    ]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    chat_line = batch_line("chat", "/v1/chat/completions", **chat)
    lines += ["{not json", completion_line("bad", top_p=9), chat_line]
    input_path = write_lines(directory / "batch.jsonl", lines)
    output = (output_dir or directory) / "batch-out.jsonl"
    argv = ["run-batch", "--model", str(model), *ENGINE_FLAGS, "-i", str(input_path),
            "-o", str(output)]  # fmt: skip
    unnamed_line = f"line {NUM_REQUESTS - 2}"  # "{not json" has no custom_id
    keys = {f"r{i}" for i in range(NUM_REQUESTS - 3)} | {"bad", "chat", unnamed_line}
    return Job("run-batch", argv, output, frozenset(keys), _batch_key)


def _batch_key(record: dict[str, Any]) -> str:
    return record["custom_id"] or f"line {record['error']['line']}"


def _generate_job(model: Path, directory: Path, output_dir: Path | None = None) -> Job:
    lines = [
        # Long enough (~0.5 s in all) for kills to land between the records' writes.
        json.dumps({"prompt": f"{i}: {PROMPT_TEXT}", "max_tokens": 12 + i % 5, "ignore_eos": True})
        for i in range(NUM_REQUESTS - 2)
    ]
    lines += ["{not json", json.dumps({"prompt": "x", "temperature": -5})]
    input_path = write_lines(directory / "prompts.jsonl", lines)
    output = (output_dir or directory) / "generate-out.jsonl"
    argv = ["generate", "--model", str(model), *ENGINE_FLAGS, "--temperature", "1.0",
            "--input", str(input_path), "--output", str(output)]  # fmt: skip
    return Job("generate", argv, output, frozenset(range(NUM_REQUESTS)), lambda r: r["index"])


JOBS = {"run-batch": _batch_job, "generate": _generate_job}


@contextmanager
def _user_file(directory: Path) -> Iterator[Path]:
    """A file of the user's beside the outputs, checked to be untouched at the end."""
    notes = directory / "notes.txt"
    notes.write_text("my notes: nothing here may ever change\n" * 50)
    before = (notes.read_bytes(), notes.stat().st_mtime_ns)
    yield notes
    assert (notes.read_bytes(), notes.stat().st_mtime_ns) == before


def _num_lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def _assert_whole_lines_then_at_most_a_torn_tail(path: Path) -> None:
    data = path.read_bytes() if path.exists() else b""
    for line in data.split(b"\n")[:-1]:
        assert isinstance(json.loads(line), dict)


def _run_killing_at_random_points(
    zygote: Zygote, job: Job, rng: random.Random, num_kills: int
) -> int:
    """Starts the job and SIGKILLs it at random points, `num_kills` times; returns the kills."""
    kills = 0
    while kills < num_kills:
        num_lines_before = _num_lines(job.output)
        pid = zygote.start(job.argv, env=CHILD_ENV)
        if rng.random() < 0.25:  # somewhere in start-up, model loading or the first steps
            time.sleep(rng.uniform(0.0, 0.5))
        else:  # after a few more results, at a random moment between two writes or in one
            target = min(
                num_lines_before + rng.randint(1, 4), len(job.expected_keys) - MIN_RECORDS_LEFT
            )
            deadline = time.monotonic() + 30
            while _num_lines(job.output) < target and time.monotonic() < deadline:
                time.sleep(0.002)
            time.sleep(rng.uniform(0.0, 0.01))
        # The child may have ended (and been reaped by the zygote) before the kill: wait() says how.
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        finished = zygote.wait()
        if finished.status == 0:
            break  # it finished before the kill landed
        assert finished.status == -signal.SIGKILL, finished.stderr
        kills += 1
        _assert_whole_lines_then_at_most_a_torn_tail(job.output)
    return kills


def test_sigkill_at_random_points_then_resume_answers_everything_once(
    cli_zygote: Zygote, tiny_checkpoint, tmp_path: Path
) -> None:
    model = tiny_checkpoint("qwen2")
    rng = random.Random(20)
    with _user_file(tmp_path) as notes:
        refused = cli_zygote.run([*_batch_job(model, tmp_path).argv[:-1], str(notes)])
        assert refused.status == ExitCode.OUTPUT_EXISTS
        num_kills = 0
        for make_job in JOBS.values():
            job = make_job(model, tmp_path)
            num_kills += _run_killing_at_random_points(cli_zygote, job, rng, KILLS_PER_COMMAND)
            finished = cli_zygote.run(job.argv, env=CHILD_ENV)
            assert finished.status == 0, finished.stderr
            job.check_answered_exactly_once()
            answered = job.output.read_bytes()
            again = cli_zygote.run(job.argv, env=CHILD_ENV)
            assert again.status == 0 and job.output.read_bytes() == answered
    assert num_kills >= 10


# ---------------------------------------------------------------- a full filesystem


@contextmanager
def _small_tmpfs(mount_point: Path, size_bytes: int) -> Iterator[Callable[[int], None]]:
    """A tmpfs of `size_bytes`; yields a function that resizes it. Skips where none mounts."""
    mount_point.mkdir()
    try:
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(mount_point)],
            capture_output=True,
            text=True,
        )
    except FileNotFoundError:
        pytest.skip("no mount command here; the RLIMIT_FSIZE case still fills a file up")
    if mounted.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs here ({mounted.stderr.strip()}); the RLIMIT_FSIZE case "
            "still fills a file up"
        )

    def resize(new_size_bytes: int) -> None:
        options = f"remount,size={new_size_bytes}"
        subprocess.run(["mount", "-o", options, str(mount_point)], check=True)

    try:
        yield resize
    finally:
        subprocess.run(["umount", str(mount_point)], check=False)


@pytest.mark.parametrize("command", list(JOBS))
@pytest.mark.parametrize("full", ["tmpfs", "file_size_limit"])
def test_a_full_disk_stops_the_run_cleanly_and_a_rerun_finishes(
    cli_zygote: Zygote, tiny_checkpoint, tmp_path: Path, command: str, full: str
) -> None:
    directory = tmp_path / "disk"
    with _disk(full, directory) as make_room:
        # The input stays outside, so that the results alone fill the disk.
        job = JOBS[command](tiny_checkpoint("qwen2"), tmp_path, output_dir=directory)
        with _user_file(directory):
            stopped = cli_zygote.run(job.argv, env=CHILD_ENV, **make_room.limits)
            _assert_stopped_on_a_full_disk(stopped, job)
            make_room()
            finished = cli_zygote.run(job.argv, env=CHILD_ENV)
            assert finished.status == 0, finished.stderr
            job.check_answered_exactly_once()


class _Room:
    """Frees the disk; `limits` are the run arguments that make it full."""

    def __init__(self, limits: dict[str, Any], free: Callable[[], None]) -> None:
        self.limits = limits
        self._free = free

    def __call__(self) -> None:
        self._free()


@contextmanager
def _disk(full: str, directory: Path) -> Iterator[_Room]:
    # Room for the user's notes and one 4 KiB page of results: run-batch's records (~600 bytes)
    # fill it after a few, generate's (~200 bytes) after about twenty.
    if full == "tmpfs":
        with _small_tmpfs(directory, 2 * 4096) as resize:
            yield _Room({}, lambda: resize(1 << 20))
    else:
        directory.mkdir()
        # Writes past this size fail with EFBIG (Python ignores SIGXFSZ); the notes are the
        # test's, written before, and never grow.
        yield _Room({"fsize_limit_bytes": 4096}, lambda: None)


def _assert_stopped_on_a_full_disk(stopped: Finished, job: Job) -> None:
    assert stopped.status == ExitCode.NO_SPACE, stopped.stderr
    error_lines = [line for line in stopped.stderr.splitlines() if "error:" in line]
    assert len(error_lines) == 1 and str(job.output) in error_lines[0]
    assert "No space left on device" in error_lines[0] or "File too large" in error_lines[0]
    records = read_records(job.output)  # whole lines only: the failed one was cut back off
    assert 0 < len(records) < len(job.expected_keys)
