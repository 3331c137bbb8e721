"""`vacpack embed | loglikelihood | classify`: a corpus file in, results streamed out in order.

Input: JSONL (one object per line: {"text": ...}, or {"context": ..., "continuation": ...}
for loglikelihood) or plain text (one document per line). Output: JSONL, one line per input
in input order: the result, or {"index": i, "error": "..."} for an input that failed.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vacpack.cli.engine_args import add_engine_args, engine_kwargs
from vacpack.corpus.input_fields import TEXT_KEYS, parse_json_object
from vacpack.corpus.packing import DocumentError
from vacpack.corpus.tasks import (
    ClassifyTask,
    CorpusTask,
    EmbedTask,
    LoglikelihoodTask,
    resolve_pooling,
    resolve_prompt,
)
from vacpack.llm import LLM
from vacpack.output_file import RecordSink, StreamWriter, check_input_file, open_output

CORPUS_RECORD_START = b'{"index":'
_RESULT_KEYS = frozenset({"embedding", "label", "logprob", "error"})


def read_corpus(path: Path, task: str, skip: int = 0) -> Iterator[Any]:
    """Streams documents from a file of any size, after the first `skip` lines; a bad line
    becomes a DocumentError (indexed from the first document streamed)."""
    with path.open("rb") as lines:
        for index, raw in enumerate(itertools.islice(lines, skip, None)):
            number = skip + index + 1
            try:
                line = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as error:
                yield DocumentError(index, f"line {number} is not UTF-8: {error}")
                continue
            if path.suffix != ".jsonl":
                yield line
                continue
            record = parse_json_object(line)
            if isinstance(record, str):
                yield DocumentError(index, f"line {number} {record}")
            elif task == "loglikelihood" and "context" in record:
                yield (str(record["context"]), str(record.get("continuation", "")))
            elif key := next((k for k in TEXT_KEYS if isinstance(record.get(k), str)), None):
                yield record[key]  # possibly empty: the task then says so
            else:
                yield DocumentError(index, f"line {number} has no text field (one of {TEXT_KEYS})")


def count_lines(path: Path) -> int:
    with path.open("rb") as data:
        return sum(1 for _ in data)


def result_record(index: int, result: Any) -> dict[str, Any]:
    if isinstance(result, DocumentError):
        return {"index": index, "error": result.message}
    if hasattr(result, "outputs") and hasattr(result.outputs, "embedding"):
        return {"index": index, "embedding": result.outputs.embedding}
    if hasattr(result, "outputs") and hasattr(result.outputs, "probs"):
        probs = dict(zip(result.outputs.labels, result.outputs.probs, strict=True))
        return {"index": index, "label": result.outputs.label, "probs": probs}
    record = {"index": index, "logprob": result.logprob, "num_tokens": result.num_tokens}
    if result.is_greedy is not None:
        record["is_greedy"] = result.is_greedy
    if result.token_logprobs is not None:
        record["token_logprobs"] = result.token_logprobs
    return record


def run_corpus_command(args: argparse.Namespace) -> int:
    # The files first: a missing input or an output that must not be touched fails in a moment,
    # not after the model has loaded.
    input_path = Path(args.input)
    check_input_file(input_path)
    num_lines = count_lines(input_path)
    sink: RecordSink = StreamWriter()
    num_done = 0
    if args.output:
        sink, num_done = open_corpus_output(Path(args.output), num_lines, args.overwrite)
    try:
        llm = LLM(args.model, **engine_kwargs(args))
        task = _task(llm, args)
        # Results come out in input order, so an earlier run answered the first `num_done`.
        documents = read_corpus(input_path, args.command, skip=num_done)
        for index, result in llm.corpus_runner.run(task, documents, num_lines - num_done):
            sink.write(result_record(num_done + index, result))
    finally:
        sink.close()
    report = llm.corpus_runner.last_report
    assert report is not None, "a job that ran left its report"
    print(report.summary(), file=sys.stderr)
    return 0


def _task(llm: LLM, args: argparse.Namespace) -> CorpusTask:
    loaded = llm.loaded
    if args.command == "embed":
        pooling = resolve_pooling(loaded, args.pooling, args.normalize, args.dimensions)
        prompt = resolve_prompt(loaded, args.prompt, args.prompt_name)
        return EmbedTask(loaded, pooling, truncate=args.truncate, prompt=prompt)
    if args.command == "classify":
        return ClassifyTask(loaded, truncate=args.truncate)
    return LoglikelihoodTask(loaded, args.token_logprobs, truncate=args.truncate)


def open_corpus_output(path: Path, num_lines: int, overwrite: bool) -> tuple[RecordSink, int]:
    """The output to append to, and how many documents an earlier run in it answered."""
    num_done = 0

    def check_record(record: dict[str, Any]) -> str | None:
        nonlocal num_done
        if record.get("index") != num_done:
            return f"has index {record.get('index')!r} where {num_done} belongs"
        if num_done >= num_lines:
            return f"answers document {num_done}, but the input has {num_lines} lines"
        if not set(record) & _RESULT_KEYS:
            return "is not a corpus result record"
        num_done += 1
        return None

    writer = open_output(
        path, record_start=CORPUS_RECORD_START, check_record=check_record, overwrite=overwrite
    )
    return writer, num_done


def add_corpus_commands(commands: argparse._SubParsersAction) -> None:
    for name, help_text in [
        ("embed", "embed every document of a corpus"),
        ("loglikelihood", "log-likelihood of documents, or of continuations after contexts"),
        ("classify", "label probabilities for every document"),
    ]:
        parser = commands.add_parser(name, help=help_text)
        add_engine_args(parser)
        parser.add_argument("--input", required=True, help=".jsonl or plain text, any size")
        parser.add_argument(
            "--output", help="JSONL results in input order (default: stdout), resumably"
        )
        parser.add_argument("--overwrite", action="store_true", help="replace an existing --output")
        parser.add_argument("--truncate", action="store_true", help="cut over-long documents")
        if name == "embed":
            parser.add_argument("--pooling", choices=["cls", "mean", "last", "max"])
            parser.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None)
            parser.add_argument(
                "--dimensions", type=int, help="keep the first N dimensions (Matryoshka)"
            )
            parser.add_argument("--prompt", help="instruction put before every text")
            parser.add_argument(
                "--prompt-name", help="the checkpoint's named prompt to put before every text"
            )
        if name == "loglikelihood":
            parser.add_argument("--token-logprobs", action="store_true")
        parser.set_defaults(handler=run_corpus_command)
