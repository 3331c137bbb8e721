"""`vacpack generate --input/--output`: prompts answered as they finish, resumably.

Each non-blank input line is a prompt: plain text, or in a .jsonl file an object with "prompt"
(or "text") and any /v1/completions field (temperature, max_tokens, top_p, stop, n, seed, ...),
checked by the server's own request validation ("stream": true is refused, as run-batch refuses
it: a record holds a whole response); the command line's sampling flags are the defaults a
line overrides. A line that is not a valid request becomes an error record naming
its line; the others are answered. Records are appended as requests finish, in completion
order: {"index": i, "line": n, "input_digest": d, "prompt": ..., "outputs": [{"text",
"finish_reason", "num_tokens"}]} or {"index": i, "line": n, "input_digest": d, "error": ...},
where `index` counts prompts from 0 and `input_digest` is a digest of the prompt's line
(lines.line_digest, as run-batch's record ids carry). Rerun with the same output to answer only
what is missing; an output whose records answer lines edited since is refused, as run-batch
refuses one: an edited request must not keep the answer to what it was.
"""

from __future__ import annotations

import logging
import sys
import time
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from vacpack.batch.lines import DIGEST_HEX_CHARS, line_digest, stream_not_supported
from vacpack.corpus.input_fields import decode_line, is_blank_line, parse_json_object
from vacpack.llm import LLM
from vacpack.openai_api.errors import APIError, bad_request, internal_error, refused_by_engine
from vacpack.openai_api.protocol import CompletionRequest, parse_body
from vacpack.openai_api.requests import PreparedGeneration, prepare_completion
from vacpack.openai_api.served_model import DEFAULT_MAX_N, check_n
from vacpack.output_file import RecordSink, StreamWriter, check_input_file, open_output
from vacpack.outputs import RequestOutput, RequestOutputKind
from vacpack.python_heap import freeze_startup_objects
from vacpack.sampling import SamplingParams
from vacpack.structured.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

GENERATE_RECORD_START = b'{"index":'
# "input_digest" is absent from records written before records carried it.
_RECORD_KEYS = frozenset({"index", "line", "input_digest", "prompt", "outputs", "error"})


@dataclass(frozen=True)
class PromptLine:
    index: int  # among the input's prompts, from 0
    line_number: int | None  # 1-based in the input file; None for --prompt texts
    fields: dict[str, Any] | None  # request fields, "prompt" included; None for a bad line
    digest: str  # line_digest of the line (of the text, for --prompt texts)
    error: str | None = None

    @property
    def record_keys(self) -> dict[str, Any]:
        """What every record of this prompt starts with ("index" first: GENERATE_RECORD_START)."""
        return {"index": self.index, "line": self.line_number, "input_digest": self.digest}


@dataclass(frozen=True)
class PromptKeys:
    """What identifies each prompt of an input, 16 bytes a prompt: its line number (0 for
    --prompt texts) and its line's digest (as an unsigned 64-bit integer)."""

    line_numbers: array[int]
    digests: array[int]

    def digest(self, index: int) -> str:
        return format(self.digests[index], f"0{DIGEST_HEX_CHARS}x")


@dataclass(frozen=True)
class PromptSource:
    """Prompts from a file (`path`) or from the command line (`texts`)."""

    path: Path | None = None
    texts: tuple[str, ...] = ()

    def lines(self) -> Iterator[PromptLine]:
        if self.path is None:
            for index, text in enumerate(self.texts):
                yield PromptLine(index, None, {"prompt": text}, _text_digest(text))
            return
        is_jsonl = self.path.suffix == ".jsonl"
        for index, (line_number, raw) in enumerate(self._prompt_lines()):
            yield _parse_line(index, line_number, raw, is_jsonl)

    def _prompt_lines(self) -> Iterator[tuple[int, bytes]]:
        """(line number, line) of every prompt of the file: its non-blank lines."""
        assert self.path is not None
        with self.path.open("rb") as source:
            for line_number, raw in enumerate(source, start=1):
                if not is_blank_line(raw):
                    yield line_number, raw

    def num_prompts(self) -> int:
        if self.path is None:
            return len(self.texts)
        return sum(1 for _ in self._prompt_lines())

    def keys(self) -> PromptKeys:
        """The line number and line digest of every prompt."""
        keys = PromptKeys(array("q"), array("Q"))
        if self.path is None:
            keys.line_numbers.extend([0] * len(self.texts))
            keys.digests.extend(int(_text_digest(text), 16) for text in self.texts)
            return keys
        for line_number, raw in self._prompt_lines():
            keys.line_numbers.append(line_number)
            keys.digests.append(int(line_digest(raw), 16))
        return keys

    def record_problem(self, record: dict[str, Any], keys: PromptKeys) -> str | None:
        """Why a record of an existing output does not answer a prompt of this input, as the
        input has it now."""
        index = record.get("index")
        fields = set(record)
        is_record = (
            fields <= _RECORD_KEYS and "line" in fields and bool(fields & {"outputs", "error"})
        )
        if not is_record or not isinstance(index, int):
            return "is not a generate output record"
        if not 0 <= index < len(keys.line_numbers):
            return f"answers prompt {index}, but the input has {len(keys.line_numbers)}"
        if (record["line"] or 0) != keys.line_numbers[index]:
            return f"answers line {record['line']}, but prompt {index} is on another line"
        if self.path is None and record.get("prompt", self.texts[index]) != self.texts[index]:
            return f"answers another prompt {index}"
        # A record written before records carried the digest is judged on the rest.
        if record.get("input_digest", keys.digest(index)) != keys.digest(index):
            where = f"line {record['line']}" if record["line"] else f"prompt {index}"
            return f"answers {where}, which has changed since"
        return None


def _text_digest(text: str) -> str:
    """A --prompt text's digest, as its line's would be ("surrogatepass": command-line
    arguments may hold undecodable bytes as lone surrogates)."""
    return line_digest(text.encode("utf-8", "surrogatepass"))


def _parse_line(index: int, line_number: int, raw: bytes, is_jsonl: bool) -> PromptLine:
    digest = line_digest(raw)
    try:
        text = decode_line(raw)
    except UnicodeDecodeError as error:
        message = f"line {line_number} is not UTF-8: {error}"
        return PromptLine(index, line_number, None, digest, message)
    if not is_jsonl:
        return PromptLine(index, line_number, {"prompt": text}, digest)
    record = parse_json_object(text)
    if isinstance(record, str):
        return PromptLine(index, line_number, None, digest, f"line {line_number} {record}")
    if "prompt" not in record and "text" in record:
        record = {"prompt": record.pop("text"), **record}
    if "prompt" not in record:
        message = f'line {line_number} has no "prompt" (or "text")'
        return PromptLine(index, line_number, None, digest, message)
    if record.get("stream") is True:
        # A completions field, checked as run-batch checks its lines' (lines.parse_line).
        message = f"line {line_number}: {stream_not_supported('generate --input files')}"
        return PromptLine(index, line_number, None, digest, message)
    return PromptLine(index, line_number, record, digest)


def request_defaults(params: SamplingParams) -> dict[str, Any]:
    """The completion request fields that the command line's sampling flags set."""
    fields: dict[str, Any] = {
        "n": params.n,
        "max_tokens": params.max_tokens,
        "min_tokens": params.min_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "min_p": params.min_p,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "repetition_penalty": params.repetition_penalty,
        "seed": params.seed,
        # Normalised to tuples by SamplingParams.__post_init__.
        "stop": list(params.stop or ()) or None,
        "stop_token_ids": list(params.stop_token_ids or ()) or None,
        "ignore_eos": params.ignore_eos,
        "logprobs": params.logprobs,
        "structured_outputs": _structured_fields(params.structured_outputs),
    }
    return {name: value for name, value in fields.items() if value is not None}


def _structured_fields(constraint: StructuredOutputsParams | None) -> dict[str, Any] | None:
    """A constraint as a request's "structured_outputs" object carries it."""
    if constraint is None:
        return None
    value = getattr(constraint, constraint.kind)
    return {constraint.kind: list(value) if isinstance(value, tuple) else value}


@dataclass(frozen=True)
class GenerateOptions:
    output_path: Path | None  # None: records go to standard output
    overwrite: bool = False
    fsync_interval_s: float = 0.0
    max_in_flight: int | None = None  # None: twice the engine's max_num_seqs
    show_progress: bool = True
    max_n: int = DEFAULT_MAX_N  # the most choices (n) one line may ask for, as the server's

    def __post_init__(self) -> None:
        if self.max_n < 1:
            raise ValueError(f"max_n must be >= 1, got {self.max_n}")


@dataclass(frozen=True)
class GenerateSummary:
    num_prompts: int
    num_resumed: int  # answered by an earlier run, skipped now
    num_answered: int  # answered by this run, errors included
    num_failed: int
    num_output_tokens: int
    elapsed_s: float


def open_generate_output(
    source: PromptSource, options: GenerateOptions
) -> tuple[RecordSink, set[int]]:
    """The output to append to, and the prompt indices an earlier run in it answered."""
    if source.path is not None:
        check_input_file(source.path)
    answered: set[int] = set()
    if options.output_path is None:
        return StreamWriter(), answered
    keys: list[PromptKeys] = []  # read from the input only if there is an output

    def check_record(record: dict[str, Any]) -> str | None:
        if not keys:
            keys.append(source.keys())
        problem = source.record_problem(record, keys[0])
        if problem is None:
            answered.add(record["index"])
        return problem

    writer = open_output(
        options.output_path,
        record_start=GENERATE_RECORD_START,
        check_record=check_record,
        overwrite=options.overwrite,
        fsync_interval_s=options.fsync_interval_s,
    )
    return writer, answered


class PromptFileRunner:
    """Feeds prompt lines to the engine (a bounded number at once) and writes what finishes."""

    def __init__(self, llm: LLM, defaults: dict[str, Any], options: GenerateOptions) -> None:
        self._engine = llm.engine
        self._tokenizer = llm.get_tokenizer()
        self._max_model_len = llm.loaded.max_model_len
        self._sampling_defaults = llm.sampling_defaults
        self._defaults = defaults
        self._max_in_flight = options.max_in_flight or 2 * llm.config.max_num_seqs
        self._show_progress = options.show_progress
        self._max_n = options.max_n
        self._pending: dict[str, PromptLine] = {}
        self._num_answered = 0
        self._num_failed = 0
        self._num_output_tokens = 0

    def run(self, source: PromptSource, writer: RecordSink, answered: set[int]) -> GenerateSummary:
        start_s = time.perf_counter()
        self._writer = writer
        num_prompts = source.num_prompts()
        self._progress = tqdm(
            total=num_prompts, desc="generate", unit="req", disable=not self._show_progress
        )
        self._progress.update(len(answered))
        try:
            for line in source.lines():
                if line.index in answered:
                    continue
                self._submit(line)
                while len(self._pending) >= self._max_in_flight:
                    self._step()
            while self._engine.has_unfinished_requests():
                self._step()
        finally:
            for request_id in list(self._pending):  # interrupted: leave nothing running
                self._engine.abort_request(request_id)
            self._progress.close()
        return GenerateSummary(
            num_prompts=num_prompts,
            num_resumed=len(answered),
            num_answered=self._num_answered,
            num_failed=self._num_failed,
            num_output_tokens=self._num_output_tokens,
            elapsed_s=time.perf_counter() - start_s,
        )

    def _submit(self, line: PromptLine) -> None:
        if line.fields is None:
            self._write_error(line, line.error or "not a prompt")
            return
        try:
            prepared = self._prepare(line)
            request_id = f"generate-{line.index}"
            prompt = prepared.prompts[0]
            try:
                self._engine.add_request(request_id, prompt.token_ids, prepared.params, prompt.text)
            except ValueError as error:
                raise refused_by_engine(error) from None
        except APIError as error:
            self._write_error(line, f"{_where(line)}{error.message}")
            return
        except Exception as error:
            # A bug this line's content hit: an error record for it, and the run goes on;
            # ending it would lose the records of every prompt in flight.
            logger.exception("line %s: unexpected error preparing it", line.line_number)
            self._write_error(line, f"{_where(line)}{internal_error(error).message}")
            return
        self._pending[request_id] = line

    def _prepare(self, line: PromptLine) -> PreparedGeneration:
        request = parse_body(CompletionRequest, {**self._defaults, **(line.fields or {})})
        check_n(request.n, self._max_n)
        prepared = prepare_completion(
            request,
            self._tokenizer,
            self._max_model_len,
            RequestOutputKind.FINAL_ONLY,
            sampling_defaults=self._sampling_defaults,
        )
        if len(prepared.prompts) != 1:
            raise bad_request("give one prompt per line, not a list", "prompt")
        if prepared.beam_search is not None:  # else its sampling would run instead, unsaid
            raise bad_request(
                "use_beam_search is not supported by generate --input: use run-batch or the server",
                "use_beam_search",
            )
        return prepared

    def _step(self) -> None:
        for output in self._engine.step():
            if output.finished:
                self._on_finished(self._pending.pop(output.request_id), output)

    def _on_finished(self, line: PromptLine, output: RequestOutput) -> None:
        completions = [
            {
                "text": completion.text,
                "finish_reason": completion.finish_reason,
                "num_tokens": len(completion.token_ids),
            }
            for completion in output.outputs
        ]
        self._num_output_tokens += sum(len(completion.token_ids) for completion in output.outputs)
        prompt = output.prompt if output.prompt is not None else (line.fields or {}).get("prompt")
        record = {**line.record_keys, "prompt": prompt, "outputs": completions}
        self._write(record, failed=False)

    def _write_error(self, line: PromptLine, message: str) -> None:
        self._write({**line.record_keys, "error": message}, failed=True)

    def _write(self, record: dict[str, Any], failed: bool) -> None:
        self._writer.write(record)
        self._num_answered += 1
        self._num_failed += failed
        self._progress.update(1)


def _where(line: PromptLine) -> str:
    """What leads a line's error message: its line number (none for a --prompt text)."""
    return f"line {line.line_number}: " if line.line_number else ""


def run_generate_file(
    llm: LLM, source: PromptSource, defaults: dict[str, Any], options: GenerateOptions
) -> GenerateSummary:
    """Answers every prompt of `source`; resumes an earlier run's output."""
    writer, answered = open_generate_output(source, options)
    try:
        return PromptFileRunner(llm, defaults, options).run(source, writer, answered)
    finally:
        writer.close()


def run_generate_command(
    model: str,
    engine_kwargs: dict[str, Any],
    source: PromptSource,
    defaults: dict[str, Any],
    options: GenerateOptions,
) -> int:
    """`vacpack generate --input/--output`: check the files, load the model, answer, report."""
    # The files first: a missing input or an output that must not be touched fails in a moment,
    # not after the model has loaded.
    writer, answered = open_generate_output(source, options)
    try:
        llm = LLM(model, **engine_kwargs)
        runner = PromptFileRunner(llm, defaults, options)
        freeze_startup_objects()  # the process answers these prompts and exits
        summary = runner.run(source, writer, answered)
    finally:
        writer.close()
    rate = summary.num_output_tokens / max(summary.elapsed_s, 1e-9)
    print(
        f"{summary.num_answered} prompts answered ({summary.num_failed} with errors), "
        f"{summary.num_resumed} already answered; {summary.num_output_tokens} output tokens in "
        f"{summary.elapsed_s:.1f} s ({rate:.1f} output tok/s) -> "
        f"{options.output_path or 'standard output'}",
        file=sys.stderr,
    )
    return 0
