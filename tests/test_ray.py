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
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("ray", reason="Ray is not installed (pip install vacpack[ray])")

import httpx
import openai
import ray
from ray import serve

from vacpack import LLM, SamplingParams
from vacpack.cli import main
from vacpack.ray import ProcessorConfig, build_processor, build_serve_app
from vacpack.server.config import ServerConfig
from vacpack.testing.tiny_models import TOKENIZER_CORPUS_PATH

ENGINE_KWARGS = {"dtype": "float32", "max_num_batched_tokens": 512, "kv_cache_memory_bytes": 2**24}
# Replicas take half a CPU each, so that Ray Data's read and write tasks still find one.
REPLICA_CPUS = 0.5
NUM_DOCUMENTS = 300


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
    corpus = tmp_path / "corpus.jsonl"
    with corpus.open("w", encoding="utf-8") as sink:
        for index, text in enumerate(documents):
            sink.write(json.dumps({"id": index, "text": text}) + "\n")
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
    assert [row["id"] for row in ray_rows] == list(range(NUM_DOCUMENTS))
    assert [row["text"] for row in ray_rows] == documents
    assert all(row["error"] is None for row in ray_rows)
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
    assert f"total: {NUM_DOCUMENTS} rows (0 failed)" in total
    assert "padding 0.00%" in total and "device busy" in total


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
    assert len(rows) < NUM_DOCUMENTS or killed_pid is not None
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


def test_server_on_ray_serve_answers_the_openai_client_from_both_replicas(
    local_ray: None, decoder_dir: Path, single_process: LLM
) -> None:
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        app = build_serve_app(
            str(decoder_dir),
            ENGINE_KWARGS,
            ServerConfig(served_model_name="tiny"),
            num_replicas=2,
            num_cpus=REPLICA_CPUS,
        )
        serve.run(app, name="vacpack", route_prefix="/")
        base_url = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
        expected = single_process.generate(
            ["Once upon a time"], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False
        )[0].outputs[0]

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

        chat_stream = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=6,
            temperature=0,
            stream=True,
        )
        deltas = [c.choices[0].delta.content or "" for c in chat_stream if c.choices]
        chat = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=6,
            temperature=0,
        )
        assert "".join(deltas) == chat.choices[0].message.content

        def replica_of_request(_: int) -> str:
            response = httpx.get(f"{base_url}/v1/models", timeout=30)
            response.raise_for_status()
            return response.headers["x-vacpack-replica"]

        with ThreadPoolExecutor(max_workers=8) as pool:
            replicas = set(pool.map(replica_of_request, range(24)))
        assert len(replicas) == 2
    finally:
        serve.shutdown()
