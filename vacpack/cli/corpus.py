"""`vacpack embed | loglikelihood | classify`: a corpus file in, results streamed out in order.

Input: JSONL (one object per line: {"text": ...}, or {"context": ..., "continuation": ...}
for loglikelihood; blank lines skipped, as run-batch skips them) or plain text (one document
per line, an empty line an empty document). Output: JSONL, one line per document in input
order: {"index": i, "line": n, "input_digest": d, ...the result} or {"index": i, "line": n,
"input_digest": d, "error": "..."} for a document that failed, where `index` counts documents
from 0, `line` is the document's line in the input (from 1) and `input_digest` a digest of that
line (vacpack.batch.lines.line_digest), by which a resumed run tells a line edited since from
the one answered.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vacpack.batch.lines import line_digest
from vacpack.cli.engine_args import add_engine_args, engine_kwargs
from vacpack.corpus.input_fields import TEXT_KEYS, decode_line, is_blank_line, parse_json_object
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


@dataclass(frozen=True)
class CorpusLine:
    """The input line that holds one document."""

    number: int  # 1-based, in the input file
    raw: bytes

    @property
    def digest(self) -> str:
        """What identifies the line's document, as run-batch identifies a request's line."""
        return line_digest(self.raw)


def corpus_lines(path: Path) -> Generator[CorpusLine, None, None]:
    """The line of every document, in file order: every line of plain text (rows match lines),
    the non-blank ones of a .jsonl file (a blank line is no record, as for every JSON Lines
    reader here: vacpack.corpus.input_fields.is_blank_line)."""
    skips_blank_lines = path.suffix == ".jsonl"
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, start=1):
            if not (skips_blank_lines and is_blank_line(raw)):
                yield CorpusLine(number, raw)


def read_corpus(path: Path, task: str, skip: int = 0) -> Iterator[Any]:
    """Streams documents from a file of any size, after the first `skip` documents; a bad line
    becomes a DocumentError (indexed from the first document streamed)."""
    is_jsonl = path.suffix == ".jsonl"
    for index, line in enumerate(itertools.islice(corpus_lines(path), skip, None)):
        yield _document(index, line, is_jsonl, task)


def _document(index: int, line: CorpusLine, is_jsonl: bool, task: str) -> Any:
    """The line's document: its text, a (context, continuation) pair, or a DocumentError."""
    try:
        text = decode_line(line.raw)
    except UnicodeDecodeError as error:
        return DocumentError(index, f"line {line.number} is not UTF-8: {error}")
    if not is_jsonl:
        return text
    record = parse_json_object(text)
    if isinstance(record, str):
        return DocumentError(index, f"line {line.number} {record}")
    if task == "loglikelihood" and "context" in record:
        return (str(record["context"]), str(record.get("continuation", "")))
    if key := next((k for k in TEXT_KEYS if isinstance(record.get(k), str)), None):
        return record[key]  # possibly empty: the task then says so
    return DocumentError(index, f"line {line.number} has no text field (one of {TEXT_KEYS})")


def count_documents(path: Path) -> int:
    return sum(1 for _ in corpus_lines(path))


def result_record(index: int, line: CorpusLine, result: Any) -> dict[str, Any]:
    """Document `index`'s record ("index" first: CORPUS_RECORD_START)."""
    record: dict[str, Any] = {"index": index, "line": line.number, "input_digest": line.digest}
    if isinstance(result, DocumentError):
        return {**record, "error": result.message}
    if hasattr(result, "outputs") and hasattr(result.outputs, "embedding"):
        return {**record, "embedding": result.outputs.embedding}
    if hasattr(result, "outputs") and hasattr(result.outputs, "probs"):
        probs = dict(zip(result.outputs.labels, result.outputs.probs, strict=True))
        return {**record, "label": result.outputs.label, "probs": probs}
    record |= {"logprob": result.logprob, "num_tokens": result.num_tokens}
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
    num_documents = count_documents(input_path)
    sink: RecordSink = StreamWriter()
    num_done = 0
    if args.output:
        sink, num_done = open_corpus_output(Path(args.output), input_path, args.overwrite)
    try:
        llm = LLM(args.model, **engine_kwargs(args))
        task = _task(llm, args)
        # Results come out in input order, so an earlier run answered the first `num_done`,
        # and the lines read alongside are those of the results, one each.
        documents = read_corpus(input_path, args.command, skip=num_done)
        lines = itertools.islice(corpus_lines(input_path), num_done, None)
        results = llm.corpus_runner.run(task, documents, num_documents - num_done)
        for (index, result), line in zip(results, lines, strict=True):
            sink.write(result_record(num_done + index, line, result))
    finally:
        sink.close()
    report = llm.corpus_runner.last_report
    assert report is not None, "a job that ran left its report"
    print(report.summary(), file=sys.stderr)
    return 0


def _task(llm: LLM, args: argparse.Namespace) -> CorpusTask:
    loaded = llm.loaded
    task: CorpusTask
    if args.command == "embed":
        pooling = resolve_pooling(loaded, args.pooling, args.normalize, args.dimensions)
        prompt = resolve_prompt(loaded, args.prompt, args.prompt_name)
        task = EmbedTask(loaded, pooling, truncate=args.truncate, prompt=prompt)
    elif args.command == "classify":
        task = ClassifyTask(loaded, truncate=args.truncate)
    else:
        return LoglikelihoodTask(loaded, args.token_logprobs, truncate=args.truncate)
    task.keep_input_tokens(args.truncate_prompt_tokens)
    return task


def open_corpus_output(path: Path, input_path: Path, overwrite: bool) -> tuple[RecordSink, int]:
    """The output to append to, and how many documents an earlier run in it answered: its
    records must answer the input's first documents, in order, on lines unchanged since."""
    num_done = 0
    lines = corpus_lines(input_path)  # read alongside the records, one line each

    def check_record(record: dict[str, Any]) -> str | None:
        nonlocal num_done
        if record.get("index") != num_done:
            return f"has index {record.get('index')!r} where {num_done} belongs"
        if not set(record) & _RESULT_KEYS:
            return "is not a corpus result record"
        line = next(lines, None)
        if line is None:
            return f"answers document {num_done}, but the input has {num_done} documents"
        problem = _answered_line_problem(record, line)
        if problem is None:
            num_done += 1
        return problem

    try:
        writer = open_output(
            path, record_start=CORPUS_RECORD_START, check_record=check_record, overwrite=overwrite
        )
    finally:
        lines.close()
    return writer, num_done


def _answered_line_problem(record: dict[str, Any], line: CorpusLine) -> str | None:
    """Why a record does not answer the document on `line`, as the input has it now; None if
    it does. A record written before records carried "line" (where every line was a document,
    its index the line's) or "input_digest" is judged on what it has."""
    answered_line = record.get("line", record["index"] + 1)
    if answered_line != line.number:
        return (
            f"answers input line {answered_line!r}, but document {record['index']} is on line "
            f"{line.number} now"
        )
    digest = record.get("input_digest", line.digest)
    if digest != line.digest:
        return f"answers input line {line.number}, which has changed since"
    return None


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
        if name in ("embed", "classify"):
            parser.add_argument(
                "--truncate-prompt-tokens",
                type=int,
                help="keep each document's first K tokens, special tokens kept (vLLM's "
                "truncate_prompt_tokens; -1: the context)",
            )
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
