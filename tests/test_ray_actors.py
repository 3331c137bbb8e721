"""vacpack.ray's batch actors called directly on pyarrow batches, as Ray Data calls them (no
cluster needed): result columns beside the input's, a failed row's reason in its error column,
the same numbers as the LLM call they wrap."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="Ray is not installed (pip install vacpack[ray])")

import pyarrow as pa

from vacpack import LLM, SamplingParams
from vacpack.ray.actors import ClassifyActor, EmbedActor, GenerateActor, LoglikelihoodActor
from vacpack.ray.figures import BatchWork, ReplicaFigures, job_figures
from vacpack.ray.files import READ_ERROR_COLUMN, drop_blank_lines, parse_json_lines
from vacpack.testing.tiny_models import build_tiny_classifier_checkpoint

ENGINE_KWARGS = {"dtype": "float32", "max_num_batched_tokens": 256, "kv_cache_memory_bytes": 2**24}
TEXTS = ["the quick brown fox", "", None, "hello world, hello there"]


@pytest.fixture(scope="module")
def decoder_dir(tiny_checkpoint) -> Path:
    return tiny_checkpoint("qwen2")


def test_embed_adds_a_column_and_fails_bad_rows_alone(decoder_dir: Path) -> None:
    actor = EmbedActor(str(decoder_dir), ENGINE_KWARGS)
    batch = pa.table({"id": [10, 11, 12, 13], "text": TEXTS})
    out = actor(batch)
    assert out.column_names == ["id", "text", "embedding", "error"]
    assert out.column("id").to_pylist() == [10, 11, 12, 13]
    errors = out.column("error").to_pylist()
    assert errors[0] is None and errors[3] is None
    assert errors[1] == "the document is empty"
    assert errors[2] == "column 'text' holds NoneType, not text or token ids"
    vectors = out.column("embedding").to_pylist()
    assert vectors[1] is None and vectors[2] is None
    reference = LLM(str(decoder_dir), **ENGINE_KWARGS).embed([TEXTS[0], TEXTS[3]], use_tqdm=False)
    assert vectors[0] == pytest.approx(reference[0].outputs.embedding, abs=1e-6)
    assert vectors[3] == pytest.approx(reference[1].outputs.embedding, abs=1e-6)
    figures = actor.figures
    assert (figures.num_batches, figures.num_rows, figures.num_failed) == (1, 4, 2)
    assert figures.num_real_tokens == sum(len(r.prompt_token_ids) for r in reference)


def test_loglikelihood_of_continuations_and_of_a_named_column(decoder_dir: Path) -> None:
    actor = LoglikelihoodActor(str(decoder_dir), ENGINE_KWARGS, return_token_logprobs=True)
    batch = pa.table({"context": ["a b", "a b", "x"], "continuation": [" c", " d", None]})
    out = actor(batch).to_pylist()
    llm = LLM(str(decoder_dir), **ENGINE_KWARGS)
    reference = llm.loglikelihood(["a b", "a b"], [" c", " d"], True, use_tqdm=False)
    for row, expected in zip(out[:2], reference, strict=True):
        assert row["logprob"] == pytest.approx(expected.logprob, abs=1e-5)
        assert row["is_greedy"] == expected.is_greedy and row["error"] is None
        assert row["token_logprobs"] == pytest.approx(expected.token_logprobs, abs=1e-5)
    assert out[2]["error"] == "'context' and 'continuation' must both be strings"
    # A file's byte-order mark opens its first line; a line of only the mark is no line.
    marked = drop_blank_lines(pa.table({"text": ['\ufeff{"context": "a"}', "\ufeff", " \t"]}))
    assert parse_json_lines(marked).to_pylist() == [{"context": "a", READ_ERROR_COLUMN: None}]
    # A block whose lines all failed to read: its own columns say what it has, not the last's.
    unreadable = parse_json_lines(pa.table({"text": ['{"context": "a', "[1]"]}))
    out = actor(unreadable).to_pylist()
    assert "is_greedy" not in out[0] and all(row["error"] for row in out)

    rolling = LoglikelihoodActor(str(decoder_dir), ENGINE_KWARGS, input_column="body")
    out = rolling(pa.table({"body": ["the quick brown fox"]})).to_pylist()
    expected = llm.loglikelihood(["the quick brown fox"], use_tqdm=False)[0]
    assert out[0]["logprob"] == pytest.approx(expected.logprob, abs=1e-5)
    assert out[0]["num_tokens"] == expected.num_tokens and "is_greedy" not in out[0]


def test_a_missing_input_column_names_the_columns(decoder_dir: Path) -> None:
    actor = EmbedActor(str(decoder_dir), ENGINE_KWARGS)
    with pytest.raises(ValueError, match=r"no input column.*\['body'\]"):
        actor(pa.table({"body": ["hello"]}))


def test_classify_gives_label_and_probs_by_label_name(tmp_path: Path) -> None:
    model_dir = build_tiny_classifier_checkpoint("qwen2", tmp_path / "classifier", num_labels=3)
    out = ClassifyActor(str(model_dir), ENGINE_KWARGS)(pa.table({"text": ["hello world", ""]}))
    rows = out.to_pylist()
    assert set(rows[0]["probs"]) == {"label_0", "label_1", "label_2"}
    assert rows[0]["probs"][rows[0]["label"]] == max(rows[0]["probs"].values())
    assert sum(rows[0]["probs"].values()) == pytest.approx(1.0, abs=1e-6)
    assert rows[1]["probs"] is None and rows[1]["error"] == "the document is empty"
    cut = ClassifyActor(str(model_dir), ENGINE_KWARGS, truncate_prompt_tokens=2)
    (row,) = cut(pa.table({"text": ["hello world, and more"]})).to_pylist()
    llm = LLM(str(model_dir), **ENGINE_KWARGS)
    (expected,) = llm.classify(["hello world, and more"], truncate_prompt_tokens=2)
    assert list(row["probs"].values()) == pytest.approx(expected.outputs.probs, abs=1e-6)


def test_generate_rows_with_their_own_sampling_params(decoder_dir: Path) -> None:
    actor = GenerateActor(str(decoder_dir), ENGINE_KWARGS, sampling_params={"max_tokens": 6})
    batch = pa.table(
        {
            "prompt": ["hello", "", "the quick", "fox"],
            "sampling_params": [
                None,
                None,
                {"max_tokens": 2, "n": None},
                {"n": 2, "max_tokens": 1},
            ],
        }
    )
    rows = actor(batch).to_pylist()
    llm = LLM(str(decoder_dir), **ENGINE_KWARGS)
    expected = llm.generate(
        ["hello", "the quick"],
        [SamplingParams(max_tokens=6), SamplingParams(max_tokens=2)],
        use_tqdm=False,
    )
    assert rows[0]["generated_text"] == expected[0].outputs[0].text
    assert rows[0]["num_generated_tokens"] == 6 and rows[0]["finish_reason"] == "length"
    assert rows[2]["generated_text"] == expected[1].outputs[0].text
    assert rows[2]["num_generated_tokens"] == 2
    assert rows[1]["error"] == "the prompt is empty: give at least one token"
    assert "one completion per row" in rows[3]["error"]
    chat = actor(pa.table({"messages": [[{"role": "user", "content": "hi"}]]})).to_pylist()
    assert chat[0]["error"] is None and chat[0]["num_generated_tokens"] == 6
    assert actor.figures.num_rows == 5 and actor.figures.num_failed == 2


def test_replica_figures_sum_over_replicas() -> None:
    first = ReplicaFigures("a", 1, "embed", load_s=1.0).with_batch(
        10, 1, BatchWork(900, 100, 2, device_busy_s=3.0, elapsed_s=3.5), 4.0, 2**30
    )
    first = first.with_batch(5, 0, BatchWork(500, 0, 1, device_busy_s=1.0, elapsed_s=1.0), 6.0, 0)
    second = ReplicaFigures("b", 2, "embed", load_s=2.0).with_batch(
        20, 0, BatchWork(1000, 0, 3, device_busy_s=2.0, elapsed_s=2.0), 4.0, 2**29
    )
    assert (first.num_batches, first.num_rows, first.num_failed) == (2, 15, 1)
    assert first.span_s == 6.0 and first.peak_memory_bytes == 2**30
    assert first.tokens_per_s == pytest.approx(1400 / 6.0)
    total = job_figures([second, first], wall_s=10.0)
    assert [r.replica for r in total.replicas] == ["a pid 1", "b pid 2"]
    assert (total.num_rows, total.num_failed, total.num_real_tokens) == (35, 1, 2400)
    assert total.tokens_per_s == pytest.approx(240.0)
    assert total.replica_tokens_per_s == pytest.approx(1400 / 6.0 + 1000 / 4.0)
    assert total.padding_overhead == pytest.approx(100 / 2500)
    assert total.device_busy_fraction == pytest.approx(6.0 / 10.0)
    assert "embed on Ray, 2 replicas:" in total.summary()


def test_embed_options_are_llm_embeds(decoder_dir: Path) -> None:
    text = "hello world, and a few more words"
    options = {"prompt": "query: ", "dimensions": 16, "truncate_prompt_tokens": 4}
    actor = EmbedActor(str(decoder_dir), ENGINE_KWARGS, **options)
    vectors = actor(pa.table({"text": [text]})).column("embedding").to_pylist()
    llm = LLM(str(decoder_dir), **ENGINE_KWARGS)
    expected = llm.embed([text], **options)
    assert len(vectors[0]) == 16
    assert vectors[0] == pytest.approx(expected[0].outputs.embedding, abs=1e-6)
    whole = llm.embed([text], prompt="query: ", dimensions=16)  # the cut changed something
    assert vectors[0] != pytest.approx(whole[0].outputs.embedding, abs=1e-6)


def test_json_lines_mixing_types_fail_only_the_odd_lines(decoder_dir: Path) -> None:
    """Arrow holds one type per column where JSON lines may mix them: the block's most common
    kind keeps its values, and each other line fails with the reason, not the whole block."""
    lines = [
        '{"id": 1, "text": "the quick brown fox"}',
        '{"id": "two", "text": "jumps over"}',
        '{"id": 3, "text": [5, 6, 7]}',
        '{"id": 4, "text": "the lazy dog", "tags": [1]}',
        '{"id": 5, "text": "again", "tags": ["x"]}',
    ]
    batch = parse_json_lines(pa.table({"text": lines}))
    out = EmbedActor(str(decoder_dir), ENGINE_KWARGS)(batch).to_pylist()
    assert [row["id"] for row in out] == [1, None, 3, 4, 5]
    errors = [row["error"] for row in out]
    assert errors[0] is None and out[0]["embedding"] is not None
    assert "'id' is a string where other lines of its block have a number" in errors[1]
    assert "'text' is a list where other lines of its block have a string" in errors[2]
    assert "'tags' does not share one type" in errors[3] and errors[3] == errors[4]
    assert "_vacpack_read_error" not in out[0]


def test_the_reading_tasks_module_imports_neither_torch_nor_transformers() -> None:
    """Ray Data's reading and writing tasks import vacpack.ray.files in fresh worker processes,
    many at once: with torch in its imports each spent seconds before reading a line."""
    heavy = "sorted(m for m in ('torch', 'transformers') if m in sys.modules)"
    finished = subprocess.run(
        [sys.executable, "-c", f"import sys, vacpack.ray.files; print({heavy})"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert finished.returncode == 0, finished.stderr
    assert finished.stdout.strip() == "[]"
