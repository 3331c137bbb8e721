"""Prompt files and corpus outputs: fields honoured, results streamed as they finish, resumed
after an interruption, a foreign output refused unless --overwrite replaces it."""

from __future__ import annotations

import codecs
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from bad_input_files import completion_line, read_records, write_lines

from vacpack import LLM, SamplingParams
from vacpack.batch.options import BatchOptions
from vacpack.batch.prompt_file import (
    GenerateOptions,
    PromptFileRunner,
    PromptSource,
    run_generate_file,
)
from vacpack.batch.runner import run_batch
from vacpack.cli import main
from vacpack.errors import ExitCode, OutputExistsError


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint) -> Path:
    return tiny_checkpoint("qwen2")


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(
        str(model_dir), dtype="float32", max_model_len=256, kv_cache_memory_bytes=4 << 20,
        max_num_seqs=8,
    )  # fmt: skip


DEFAULTS = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}


def _texts(output) -> list[str]:
    return [completion.text for completion in output.outputs]


def test_per_line_fields_override_the_flags(llm: LLM, tmp_path: Path) -> None:
    lines = [
        {"prompt": "hello"},
        {"prompt": "hello", "max_tokens": 3},
        {"text": "the sea", "max_tokens": 4, "n": 2, "temperature": 1.0, "seed": 7},
    ]
    source = PromptSource(write_lines(tmp_path / "in.jsonl", [json.dumps(x) for x in lines]))
    options = GenerateOptions(tmp_path / "out.jsonl", show_progress=False)
    run_generate_file(llm, source, DEFAULTS, options)
    records = {r["index"]: r for r in read_records(tmp_path / "out.jsonl")}

    greedy = SamplingParams(temperature=0, ignore_eos=True, max_tokens=6)
    expected = llm.generate(["hello"], greedy, use_tqdm=False)[0]
    assert [o["text"] for o in records[0]["outputs"]] == _texts(expected)
    assert records[0]["outputs"][0]["num_tokens"] == 6
    assert records[1]["outputs"][0]["num_tokens"] == 3
    assert expected.outputs[0].text.startswith(records[1]["outputs"][0]["text"])
    sampled = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=4, ignore_eos=True)
    reference = llm.generate(["the sea"], sampled, use_tqdm=False)[0]
    assert [o["text"] for o in records[2]["outputs"]] == _texts(reference)
    assert records[2]["prompt"] == "the sea" and records[2]["line"] == 3


class _RecordingSink:
    """Notes, for each record written, whether the engine was still running other requests."""

    def __init__(self, llm: LLM) -> None:
        self._llm = llm
        self.writes: list[tuple[int, bool]] = []

    def write(self, record: dict[str, Any]) -> None:
        self.writes.append((record["index"], self._llm.engine.has_unfinished_requests()))

    def close(self) -> None:
        pass


def test_results_are_written_as_they_finish(llm: LLM, tmp_path: Path) -> None:
    lines = [json.dumps({"prompt": "a long one", "max_tokens": 20})]
    lines += [json.dumps({"prompt": f"short {i}", "max_tokens": 1}) for i in range(3)]
    source = PromptSource(write_lines(tmp_path / "in.jsonl", lines))
    sink = _RecordingSink(llm)
    runner = PromptFileRunner(llm, DEFAULTS, GenerateOptions(None, show_progress=False))
    runner.run(source, sink, answered=set())
    assert [index for index, _ in sink.writes][-1] == 0  # the long one finishes last
    assert all(still_running for index, still_running in sink.writes if index != 0)


def test_generate_resumes_after_a_torn_tail(llm: LLM, tmp_path: Path) -> None:
    lines = [json.dumps({"prompt": f"prompt {i}", "max_tokens": 2 + i % 3}) for i in range(8)]
    lines.insert(3, "{not json")
    source = PromptSource(write_lines(tmp_path / "in.jsonl", lines))
    options = GenerateOptions(tmp_path / "out.jsonl", show_progress=False)
    first = run_generate_file(llm, source, DEFAULTS, options)
    assert (first.num_answered, first.num_failed) == (9, 1)
    complete = {r["index"]: r for r in read_records(options.output_path)}
    whole_lines = options.output_path.read_bytes().splitlines(keepends=True)
    options.output_path.write_bytes(b"".join(whole_lines[:4]) + whole_lines[4][:25])

    resumed = run_generate_file(llm, source, DEFAULTS, options)
    assert (resumed.num_resumed, resumed.num_answered) == (4, 5)
    records = read_records(options.output_path)
    assert sorted(r["index"] for r in records) == list(range(9))
    assert {r["index"]: r for r in records} == complete  # greedy: the same answers again


def test_corpus_command_resumes_in_order(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = write_lines(tmp_path / "in.txt", [f"document number {i}" for i in range(6)])
    output = tmp_path / "out.jsonl"
    argv = ["loglikelihood", "--model", str(model_dir), "--dtype", "float32",
            "--input", str(corpus), "--output", str(output)]  # fmt: skip
    assert main(argv) == 0
    complete = read_records(output)
    assert [r["index"] for r in complete] == list(range(6))
    whole_lines = output.read_bytes().splitlines(keepends=True)
    output.write_bytes(b"".join(whole_lines[:2]) + whole_lines[2][:10])

    assert main(argv) == 0
    resumed = read_records(output)
    assert [r["index"] for r in resumed] == list(range(6))
    for got, expected in zip(resumed, complete, strict=True):
        assert got["logprob"] == pytest.approx(expected["logprob"], rel=1e-5)

    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    assert main([*argv[:-1], str(notes)]) == ExitCode.OUTPUT_EXISTS
    assert notes.read_text() == "my notes\n"
    assert "--overwrite" in capsys.readouterr().err


def test_overwrite_replaces_a_foreign_output(llm: LLM, tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("replace me\n")
    input_path = write_lines(tmp_path / "in.jsonl", [completion_line("a")])
    options = BatchOptions(input_path, notes, show_progress=False, overwrite=True)
    assert run_batch(llm, options).num_answered == 1
    (record,) = read_records(notes)
    assert record["custom_id"] == "a" and record["response"]["status_code"] == 200


def _corpus_argv(model_dir: Path, corpus: Path, output: Path, *flags: str) -> list[str]:
    return ["loglikelihood", "--model", str(model_dir), "--dtype", "float32",
            "--input", str(corpus), "--output", str(output), *flags]  # fmt: skip


def test_corpus_command_skips_blank_jsonl_lines_as_run_batch_does(
    model_dir: Path, tmp_path: Path
) -> None:
    """A blank or whitespace-only line of a .jsonl corpus is no document (it was an "is not
    valid JSON" error row); each record names the line its document is on, and resumes."""
    texts = [f"document number {i}" for i in range(4)]
    lines = ["", json.dumps({"text": texts[0]}), "   \t", json.dumps({"text": texts[1]})]
    lines += [json.dumps({"text": texts[2]}), "", json.dumps({"text": texts[3]}), " "]
    corpus = write_lines(tmp_path / "in.jsonl", lines)
    output = tmp_path / "out.jsonl"
    assert main(_corpus_argv(model_dir, corpus, output)) == 0
    complete = read_records(output)
    assert [r["index"] for r in complete] == [0, 1, 2, 3]
    assert [r["line"] for r in complete] == [2, 4, 5, 7]
    assert not [r for r in complete if "error" in r]
    whole_lines = output.read_bytes().splitlines(keepends=True)
    output.write_bytes(b"".join(whole_lines[:2]) + whole_lines[2][:10])

    assert main(_corpus_argv(model_dir, corpus, output)) == 0
    resumed = read_records(output)
    assert [(r["index"], r["line"]) for r in resumed] == [(0, 2), (1, 4), (2, 5), (3, 7)]
    for got, expected in zip(resumed, complete, strict=True):
        assert got["logprob"] == pytest.approx(expected["logprob"], rel=1e-5)


def test_corpus_resume_refuses_an_output_whose_input_lines_have_changed(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = [json.dumps({"text": f"document number {i}"}) for i in range(3)]
    corpus = write_lines(tmp_path / "in.jsonl", lines)
    output = tmp_path / "out.jsonl"
    argv = _corpus_argv(model_dir, corpus, output)
    assert main(argv) == 0
    answered = output.read_bytes()

    # An answered line edited: its record answers a document the input no longer has.
    write_lines(corpus, [lines[0], json.dumps({"text": "another document"}), lines[2]])
    capsys.readouterr()
    assert main(argv) == ExitCode.OUTPUT_EXISTS
    error = capsys.readouterr().err
    assert "line 2 answers input line 2, which has changed since" in error
    assert "--overwrite" in error
    assert output.read_bytes() == answered  # refused untouched
    # A line put above moves the answered documents: their records would name other lines.
    write_lines(corpus, ["", *lines])
    assert main(argv) == ExitCode.OUTPUT_EXISTS
    assert "answers input line 1, but document 0 is on line 2 now" in capsys.readouterr().err

    # A line not answered yet may change: the interrupted run resumes with the new document.
    write_lines(corpus, [*lines[:2], json.dumps({"text": "a new last document"})])
    output.write_bytes(b"".join(answered.splitlines(keepends=True)[:2]))
    assert main(argv) == 0
    assert [r["line"] for r in read_records(output)] == [1, 2, 3]

    # A record written before records carried "line" and "input_digest" still resumes.
    legacy = [{"index": r["index"], "logprob": r["logprob"]} for r in read_records(output)[:2]]
    output.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in legacy))
    assert main(argv) == 0
    assert [r["index"] for r in read_records(output)] == [0, 1, 2]

    # --overwrite answers the edited file afresh.
    write_lines(corpus, [lines[0], json.dumps({"text": "another document"}), lines[2]])
    assert main([*argv, "--overwrite"]) == 0
    assert [r["line"] for r in read_records(output)] == [1, 2, 3]


def test_generate_resume_refuses_an_output_whose_input_lines_have_changed(
    llm: LLM, tmp_path: Path
) -> None:
    lines = [json.dumps({"prompt": f"prompt {i}", "max_tokens": 2}) for i in range(3)]
    input_path = write_lines(tmp_path / "in.jsonl", lines)
    source = PromptSource(input_path)
    options = GenerateOptions(tmp_path / "out.jsonl", show_progress=False)
    run_generate_file(llm, source, DEFAULTS, options)
    answered = options.output_path.read_bytes()

    # A BOM and CRLF line ends change no prompt: the run resumes with nothing left to do.
    input_path.write_bytes(b"\xef\xbb\xbf" + input_path.read_bytes().replace(b"\n", b"\r\n"))
    assert run_generate_file(llm, source, DEFAULTS, options).num_resumed == 3

    # An answered line edited (its max_tokens, which its record does not show): refused.
    edited = [lines[0], json.dumps({"prompt": "prompt 1", "max_tokens": 4}), lines[2]]
    write_lines(input_path, edited)
    with pytest.raises(OutputExistsError, match="answers line 2, which has changed since"):
        run_generate_file(llm, source, DEFAULTS, options)
    assert options.output_path.read_bytes() == answered  # refused untouched

    # A line not answered yet may change: the interrupted run answers the new request.
    kept = [r for r in answered.splitlines(keepends=True) if b'"index":1,' not in r]
    options.output_path.write_bytes(b"".join(kept))
    assert run_generate_file(llm, source, DEFAULTS, options).num_answered == 1
    records = {r["index"]: r for r in read_records(options.output_path)}
    assert records[1]["outputs"][0]["num_tokens"] == 4

    # A record written before records carried "input_digest" still resumes.
    legacy = [{k: v for k, v in r.items() if k != "input_digest"} for r in records.values()]
    options.output_path.write_text("".join(json.dumps(r) + "\n" for r in legacy))
    assert run_generate_file(llm, source, DEFAULTS, options).num_resumed == 3

    # --overwrite answers the edited file afresh.
    write_lines(input_path, lines)
    overwrite = dataclasses.replace(options, overwrite=True)
    assert run_generate_file(llm, source, DEFAULTS, overwrite).num_answered == 3


def _with_byte_order_mark(path: Path) -> Path:
    """A copy of the file whose first line starts with a UTF-8 byte-order mark, as Windows
    Notepad (and Excel's "CSV UTF-8") save one."""
    marked = path.with_name(f"marked-{path.name}")
    marked.write_bytes(codecs.BOM_UTF8 + path.read_bytes())
    return marked


def test_a_byte_order_mark_opens_a_prompt_file_as_it_opens_a_batch_file(
    llm: LLM, tmp_path: Path
) -> None:
    """A mark before the first line is no part of it: generate --input answers the line as it
    answers it without one (it was "line 1 is not valid JSON", or a prompt starting with
    U+FEFF), as run-batch does."""
    for name, lines in (
        ("in.jsonl", [json.dumps({"prompt": "hello"}), json.dumps({"prompt": "the sea"})]),
        ("in.txt", ["hello", "the sea"]),
    ):
        plain = write_lines(tmp_path / name, lines)
        answers = []
        for path in (plain, _with_byte_order_mark(plain)):
            options = GenerateOptions(tmp_path / f"{path.name}.out", show_progress=False)
            run_generate_file(llm, PromptSource(path), DEFAULTS, options)
            answers.append(sorted(read_records(options.output_path), key=lambda r: r["index"]))
        assert answers[1] == answers[0], name
    batch = _with_byte_order_mark(write_lines(tmp_path / "batch.jsonl", [completion_line("a")]))
    run_batch(llm, BatchOptions(batch, tmp_path / "batch.out", show_progress=False))
    (record,) = read_records(tmp_path / "batch.out")
    assert record["response"]["status_code"] == 200


def test_a_byte_order_mark_opens_a_corpus_as_it_opens_a_batch_file(
    model_dir: Path, tmp_path: Path
) -> None:
    for name, lines in (
        ("in.jsonl", [json.dumps({"text": "document one"}), json.dumps({"text": "and two"})]),
        ("in.txt", ["document one", "and two"]),
    ):
        plain = write_lines(tmp_path / name, lines)
        answers = []
        for path in (plain, _with_byte_order_mark(plain)):
            output = tmp_path / f"{path.name}.out"
            assert main(_corpus_argv(model_dir, path, output)) == 0
            answers.append(read_records(output))
        marked, unmarked = answers[1], answers[0]
        assert not [r for r in marked if "error" in r], marked
        keys = ("index", "line", "input_digest", "num_tokens")
        assert [[r[k] for k in keys] for r in marked] == [[r[k] for k in keys] for r in unmarked]
        assert [r["logprob"] for r in marked] == pytest.approx([r["logprob"] for r in unmarked])


def test_a_first_line_of_only_a_byte_order_mark_is_skipped_as_blank(
    model_dir: Path, tmp_path: Path
) -> None:
    corpus = tmp_path / "in.jsonl"
    corpus.write_bytes(codecs.BOM_UTF8 + b"\n" + json.dumps({"text": "a document"}).encode())
    output = tmp_path / "out.jsonl"
    assert main(_corpus_argv(model_dir, corpus, output)) == 0
    (record,) = read_records(output)
    assert (record["index"], record["line"]) == (0, 2) and "error" not in record


def test_a_prompt_line_asking_to_stream_gets_its_own_error_record(llm: LLM, tmp_path: Path) -> None:
    """As run-batch answers such a line: a record holds a whole response, so "stream": true is
    refused by its line's record, not silently ignored; "stream": false asks for what a prompt
    file does anyway."""
    lines = [json.dumps({"prompt": "hello", "stream": stream}) for stream in (True, False)]
    source = PromptSource(
        write_lines(tmp_path / "in.jsonl", [*lines, json.dumps({"prompt": "hello"})])
    )
    options = GenerateOptions(tmp_path / "out.jsonl", show_progress=False)
    summary = run_generate_file(llm, source, DEFAULTS, options)
    assert (summary.num_answered, summary.num_failed) == (3, 1)
    records = {r["index"]: r for r in read_records(options.output_path)}
    assert records[0]["error"].startswith(
        "line 1: stream is not supported in generate --input files (each record holds a whole "
        'response): drop "stream" or set it to false'
    )
    assert records[1]["outputs"] == records[2]["outputs"]
    assert run_generate_file(llm, source, DEFAULTS, options).num_resumed == 3  # resumes as any
