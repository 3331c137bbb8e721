"""vacpack over a local Ray instance: corpus jobs on 2 replicas equal the single-process job row
for row and in order, a replica killed mid-job loses and repeats no row, and the OpenAI server
on Ray Serve answers the official client, plain and streaming, from both replicas.

One Ray instance (2 CPUs, a small object store) serves the whole module; its start-up is most
of the time these tests take.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("ray", reason="Ray is not installed (pip install vacpack[ray])")

import httpx
import openai
import ray

from vacpack import LLM, SamplingParams
from vacpack.cli import main
from vacpack.errors import ExitCode
from vacpack.ray import ProcessorConfig, build_processor
from vacpack.testing.tiny_models import TOKENIZER_CORPUS_PATH

ENGINE_KWARGS = {"dtype": "float32", "max_num_batched_tokens": 512, "kv_cache_memory_bytes": 2**24}
# Replicas take half a CPU each, so that Ray Data's read and write tasks still find one.
REPLICA_CPUS = 0.5
NUM_DOCUMENTS = 120
API_KEY = "test-key"
SERVE_START_TIMEOUT_S = 180.0
MAX_REQUEST_ROUNDS = 25  # of 8 concurrent requests, until both replicas have answered


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    try:
        ray.init(
            address="local",
            num_cpus=2,
            object_store_memory=256 * 2**20,
            include_dashboard=False,
            log_to_driver=False,
        )
    except Exception as error:  # Ray's own start-up: nothing of vacpack's runs before it
        pytest.skip(f"Ray cannot start here: {type(error).__name__}: {error}")
    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True
    context.enable_progress_bars = False
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def decoder_dir(tiny_checkpoint) -> Path:
    return tiny_checkpoint("qwen2")


@pytest.fixture(scope="module")
def documents() -> list[str]:
    """Real text, 1 to 80 words each."""
    words = TOKENIZER_CORPUS_PATH.read_text(encoding="utf-8").split()
    generator = np.random.default_rng(0)
    texts = []
    for _ in range(NUM_DOCUMENTS):
        num_words = int(generator.integers(1, 80))
        start = int(generator.integers(0, len(words) - num_words))
        texts.append(" ".join(words[start : start + num_words]))
    return texts


@pytest.fixture(scope="module")
def single_process(decoder_dir: Path) -> LLM:
    return LLM(str(decoder_dir), **ENGINE_KWARGS)


def _read_jsonl_directory(directory: Path) -> list[dict]:
    """Ray Data's output files, in name order (input order when order is preserved)."""
    rows = []
    for path in sorted(directory.iterdir()):
        rows.extend(json.loads(line) for line in path.read_text(encoding="utf-8").splitlines())
    return rows


def test_loglikelihood_command_on_two_replicas_equals_the_single_process_command(
    local_ray: None, decoder_dir: Path, documents: list[str], tmp_path: Path, capsys
) -> None:
    """Two malformed lines among them get their error, in place, in both; every other row
    equals the single-process row."""
    lines = [json.dumps({"id": index, "text": text}) for index, text in enumerate(documents)]
    malformed = {7: '{"id": "cut off', 70: '["not", "an object"]'}
    for position in sorted(malformed):
        lines.insert(position, malformed[position])
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(lines) + "\n", encoding="utf-8")
    engine_flags = ["--model", str(decoder_dir), "--dtype", "float32"]
    engine_flags += ["--max-num-batched-tokens", "512"]
    single_output = tmp_path / "single.jsonl"
    command = ["loglikelihood", *engine_flags, "--input", str(corpus), "--token-logprobs"]
    assert main([*command, "--output", str(single_output)]) == 0
    capsys.readouterr()
    ray_output = tmp_path / "ray_out"
    ray_flags = ["--ray", "--num-replicas", "2", "--cpus-per-replica", str(REPLICA_CPUS)]
    ray_flags += ["--batch-size", "32"]
    assert main([*command, *ray_flags, "--output", str(ray_output)]) == 0

    single_rows = [json.loads(line) for line in single_output.read_text().splitlines()]
    ray_rows = _read_jsonl_directory(ray_output)
    assert len(ray_rows) == len(single_rows) == len(lines)
    for rows in (ray_rows, single_rows):
        failed = {i: row["error"] for i, row in enumerate(rows) if row.get("error") is not None}
        assert set(failed) == set(malformed)
        assert "not valid JSON" in failed[7] and "not a JSON object" in failed[70]
    ray_rows = [row for row in ray_rows if row["error"] is None]
    single_rows = [row for row in single_rows if "error" not in row]
    assert [row["id"] for row in ray_rows] == list(range(NUM_DOCUMENTS))
    assert [row["text"] for row in ray_rows] == documents
    assert [row["num_tokens"] for row in ray_rows] == [row["num_tokens"] for row in single_rows]
    # Bins hold other neighbours on each side, so float32 sums may round differently.
    np.testing.assert_allclose(
        [row["logprob"] for row in ray_rows], [row["logprob"] for row in single_rows], rtol=1e-5
    )
    for ray_row, single_row in zip(ray_rows, single_rows, strict=True):
        np.testing.assert_allclose(
            ray_row["token_logprobs"], single_row["token_logprobs"], atol=1e-4
        )

    report = capsys.readouterr().err
    assert "loglikelihood on Ray, " in report
    total = next(line for line in report.splitlines() if line.strip().startswith("total:"))
    assert f"total: {len(lines)} rows ({len(malformed)} failed)" in total
    assert "padding 0.00%" in total and "device busy" in total


def test_a_single_parquet_file_comes_in_blocks_for_every_replica_in_order(
    local_ray: None, documents: list[str], tmp_path: Path
) -> None:
    """A small Parquet file holds one row group, which Ray Data reads as one block: without a
    split, one replica would run the whole job."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from vacpack.ray.files import read_dataset

    path = tmp_path / "corpus.parquet"
    pq.write_table(pa.table({"text": documents}), path)
    assert pq.ParquetFile(path).num_row_groups == 1
    dataset = read_dataset(str(path), min_num_blocks=4).materialize()
    assert dataset.num_blocks() == 4
    assert [row["text"] for row in dataset.take_all()] == documents


def test_ray_commands_refuse_what_cannot_run(
    local_ray: None, decoder_dir: Path, tmp_path: Path, capsys
) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "hello"}\n')
    command = ["embed", "--model", str(decoder_dir), "--input", str(corpus), "--ray"]
    assert main(command) == 2
    assert "give --output DIRECTORY" in capsys.readouterr().err
    # Two replicas of a CPU each would hold both CPUs, and Ray Data's reads would wait forever.
    too_many = [*command, "--output", str(tmp_path / "out"), "--num-replicas", "2"]
    assert main(too_many) == 2
    assert "leave no CPU of the cluster's 2 free" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    # A model the replicas would not find, said as the single-process command says it.
    missing = ["embed", "--model", str(tmp_path / "no-such-model"), "--input", str(corpus)]
    assert main([*missing, "--ray", "--output", str(tmp_path / "out")]) == ExitCode.MODEL_NOT_FOUND
    assert "no-such-model' is not a directory" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    samples = ["generate", "--model", str(decoder_dir), "--prompt", "hi", "--n", "2", "--ray"]
    assert main([*samples, "--output", str(tmp_path / "out")]) == 2
    assert "one completion per row" in capsys.readouterr().err
    # A runtime adapter load would reach one replica of several.
    updating = ["serve", "--model", str(decoder_dir), "--enable-lora"]
    assert main([*updating, "--allow-runtime-lora-updating", "--ray"]) == 2
    assert "changes one replica only" in capsys.readouterr().err


def test_a_replica_killed_mid_job_loses_and_repeats_no_row(
    local_ray: None, decoder_dir: Path, documents: list[str], single_process: LLM
) -> None:
    dataset = ray.data.from_items(
        [{"id": index, "text": text} for index, text in enumerate(documents)],
        override_num_blocks=16,
    )
    config = ProcessorConfig(
        model=str(decoder_dir),
        task="embed",
        engine_kwargs=ENGINE_KWARGS,
        concurrency=2,
        batch_size=8,
        num_cpus=REPLICA_CPUS,
    )
    rows: list[dict] = []
    killed_pid = None
    with build_processor(config) as processor:
        for batch in processor(dataset).iter_batches(batch_size=None, batch_format="pyarrow"):
            rows.extend(batch.to_pylist())
            if killed_pid is None:
                # A replica that has answered a batch and has more queued: gone at once, as
                # when its node dies. Ray restarts it and runs its unfinished batches again.
                killed_pid = processor.figures(0.0).replicas[0].pid
                os.kill(killed_pid, signal.SIGKILL)
        replicas = processor.figures(0.0).replicas
    assert killed_pid is not None
    assert [row["id"] for row in rows] == list(range(NUM_DOCUMENTS))
    expected = single_process.embed(documents, use_tqdm=False)
    np.testing.assert_allclose(
        [row["embedding"] for row in rows], [e.outputs.embedding for e in expected], atol=1e-5
    )
    assert killed_pid in {r.pid for r in replicas}
    # The replacement is a new process that reported its own batches.
    assert len(replicas) == 3


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _exercise_the_server(base_url: str, expected: Any) -> set[str]:
    """The official client, plain and streaming; returns the replicas that answered."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0)
    completion = client.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0
    )
    assert completion.choices[0].text == expected.text
    assert completion.usage.completion_tokens == len(expected.token_ids)

    stream = client.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0, stream=True
    )
    pieces = [chunk.choices[0].text for chunk in stream if chunk.choices]
    assert len(pieces) > 1 and "".join(pieces) == expected.text

    messages = [{"role": "user", "content": "hello"}]
    chat_stream = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0, stream=True
    )
    deltas = [c.choices[0].delta.content or "" for c in chat_stream if c.choices]
    chat = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0
    )
    assert "".join(deltas) == chat.choices[0].message.content

    unauthorized = httpx.get(f"{base_url}/v1/models", timeout=30)
    assert unauthorized.status_code == 401
    assert unauthorized.json()["error"]["code"] == "invalid_api_key"

    def replica_of_request(_: int) -> str:
        response = httpx.get(
            f"{base_url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30
        )
        response.raise_for_status()
        return response.headers["x-vacpack-replica"]

    # Serve's router prefers a replica whose queue length it has cached until it has probed
    # the other: requests reach both, but not from the very first.
    replicas: set[str] = set()
    with ThreadPoolExecutor(max_workers=8) as pool:
        for _ in range(MAX_REQUEST_ROUNDS):
            replicas.update(pool.map(replica_of_request, range(8)))
            if len(replicas) == 2:
                break
    return replicas


def _wait_until_up(base_url: str, deadline_s: float) -> None:
    while time.monotonic() < deadline_s:
        try:
            if httpx.get(f"{base_url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"nothing answered on {base_url} in time")


def test_serve_command_on_ray_serve_answers_the_openai_client_from_both_replicas(
    local_ray: None, decoder_dir: Path, single_process: LLM
) -> None:
    """`vacpack serve --ray` in this process, stopped by SIGTERM as a supervisor stops it."""
    port = _free_port()
    base_url = f"http://127.0.0.1:{port}"
    expected = single_process.generate(
        ["Once upon a time"], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False
    )[0].outputs[0]
    outcome: dict[str, Any] = {}

    def client_then_stop() -> None:
        try:
            _wait_until_up(base_url, time.monotonic() + SERVE_START_TIMEOUT_S)
            outcome["replicas"] = _exercise_the_server(base_url, expected)
        except BaseException as error:  # handed to the test's thread
            outcome["error"] = error
        finally:
            # Only once the command has put its handler in: SIGTERM would end pytest otherwise.
            if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
                os.kill(os.getpid(), signal.SIGTERM)

    client = threading.Thread(target=client_then_stop)
    client.start()
    command = ["serve", "--model", str(decoder_dir), "--dtype", "float32"]
    command += ["--max-num-batched-tokens", "512", "--kv-cache-memory-bytes", str(2**24)]
    command += ["--served-model-name", "tiny", "--port", str(port), "--api-key", API_KEY]
    command += ["--ray", "--num-replicas", "2", "--cpus-per-replica", str(REPLICA_CPUS)]
    try:
        assert main(command) == 0
    finally:
        client.join(timeout=SERVE_START_TIMEOUT_S)
    if "error" in outcome:
        raise outcome["error"]
    assert len(outcome["replicas"]) == 2
    with pytest.raises(httpx.TransportError):  # the command shut Serve's proxy down
        httpx.get(f"{base_url}/health", timeout=5)
