"""Answer an OpenAI batch file with the engine, streaming: flat memory, resumable, never idle.

Input lines are read one at a time and taken in while fewer than `max_in_flight` prompts are
in the engine; between every two engine steps finished requests are written out and new lines
taken in, so the engine's queue never runs dry while input remains. Embedding, score and rerank
lines are gathered up to the same bound (in inputs) and run as packed jobs. Requests are
translated and answered by vacpack.openai_api, the same code the HTTP server uses.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from tqdm.auto import tqdm

from vacpack.batch.beam_lines import BeamLines
from vacpack.batch.line_requests import LineTranslator, ReadyLine
from vacpack.batch.lines import (
    DUPLICATE_CUSTOM_ID,
    BatchLine,
    LineError,
    count_requests,
    iter_lines,
)
from vacpack.batch.options import BatchOptions
from vacpack.batch.records import line_error_record, response_record
from vacpack.batch.result_file import AnsweredSet, open_batch_output
from vacpack.llm import LLM
from vacpack.lora.modules import lora_requests
from vacpack.openai_api.errors import APIError, internal_error, refused_by_engine
from vacpack.openai_api.logprobs import DecodeToken
from vacpack.openai_api.pooling import (
    run_pooling_apart_on_failure,
)
from vacpack.openai_api.responses import (
    PromptResult,
    generation_body,
    now_s,
)
from vacpack.openai_api.serving import (
    generation_engine,
    load_served_adapters,
    pooling_functions,
)
from vacpack.output_file import RecordSink, check_input_file
from vacpack.outputs import RequestOutput
from vacpack.python_heap import freeze_startup_objects

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchSummary:
    num_requests: int  # non-blank input lines
    num_resumed: int  # answered by an earlier run, skipped now
    num_answered: int  # answered by this run, errors included
    num_failed: int  # answered by this run with an error
    # Of those, lines whose custom_id an earlier line has (each answered with an error record).
    num_duplicates: int
    num_output_tokens: int
    peak_in_flight: int  # most prompts (or embedding inputs) held at once
    elapsed_s: float


@dataclass
class _Pending:
    """A generation line whose prompts are in the engine."""

    ready: ReadyLine
    created: int
    results: list[PromptResult | None]
    num_unfinished: int


class BatchRunner:
    def __init__(self, llm: LLM, options: BatchOptions) -> None:
        self._engine = generation_engine(llm)
        self._pooling = pooling_functions(llm)
        tokenizer = llm.get_tokenizer()
        self._decode_token = DecodeToken(tokenizer)
        self._model_name = options.served_model_name or llm.config.model
        adapters = lora_requests(options.lora_modules, self._model_name)
        load_served_adapters(llm, self._engine, adapters)  # a bad adapter stops the run here
        max_model_len = llm.loaded.max_model_len
        self._translator = LineTranslator(
            options,
            self._model_name,
            adapters,
            generates=self._engine is not None,
            tokenizer=tokenizer,
            max_model_len=max_model_len,
            sampling_defaults=llm.sampling_defaults,
            pooling=self._pooling,
            scheduling_policy=llm.config.scheduling_policy,
        )
        self._options = options
        self._max_in_flight = options.max_in_flight or 2 * llm.config.max_num_seqs
        self._pending: dict[str, tuple[_Pending, int]] = {}  # engine request id -> (line, prompt)
        # Lines with use_beam_search: their searches' step requests.
        self._beams: BeamLines[ReadyLine] | None = (
            BeamLines(self._engine, llm.loaded.eos_token_ids, max_model_len, tokenizer)
            if self._engine is not None
            else None
        )
        self._pooling_buffer: list[ReadyLine] = []
        self._num_resumed = 0
        self._num_answered = 0
        self._num_failed = 0
        self._num_duplicates = 0
        self._num_output_tokens = 0
        self._peak_in_flight = 0

    def run(self, writer: RecordSink, answered: AnsweredSet) -> BatchSummary:
        """Answers every input line not in `answered`, appending the records to `writer`."""
        start_s = time.perf_counter()
        options = self._options
        num_requests = count_requests(options.input_path)
        self._writer = writer
        self._progress = tqdm(
            total=num_requests, desc="run-batch", unit="req", disable=not options.show_progress
        )
        try:
            self._feed_and_drain(iter_lines(options.input_path), answered)
        finally:
            if self._engine is not None:  # interrupted: leave nothing running
                self._engine.abort_request(self._in_flight_ids)
            self._progress.close()
        return BatchSummary(
            num_requests=num_requests,
            num_resumed=self._num_resumed,
            num_answered=self._num_answered,
            num_failed=self._num_failed,
            num_duplicates=self._num_duplicates,
            num_output_tokens=self._num_output_tokens,
            peak_in_flight=self._peak_in_flight,
            elapsed_s=time.perf_counter() - start_s,
        )

    def _feed_and_drain(
        self, lines: Iterator[BatchLine | LineError], answered: AnsweredSet
    ) -> None:
        held: ReadyLine | None = None
        exhausted = False
        while True:
            # Take lines in up to the bound; the line that would cross it waits for room.
            while not exhausted:
                if held is None:
                    item = next(lines, None)
                    if item is None:
                        exhausted = True
                        break
                    held = self._triage(item, answered)
                    if held is None:
                        continue
                if held.pooling is not None:
                    if (
                        self._pooling_buffer
                        and self._num_buffered + held.size > self._max_in_flight
                    ):
                        self._flush_pooling()
                    self._pooling_buffer.append(held)
                    self._note_in_flight(self._num_buffered)
                elif self._in_flight_ids and self._num_in_flight + held.size > self._max_in_flight:
                    break
                else:
                    self._submit(held)
                held = None
            if self._engine is not None and self._engine.has_unfinished_requests():
                for output in self._engine.step():
                    self._on_output(output)
            elif exhausted:
                self._flush_pooling()
                return

    # ------------------------------------------------------------ lines in
    def _triage(self, item: BatchLine | LineError, answered: AnsweredSet) -> ReadyLine | None:
        """A line ready to run, or None when it was skipped or answered right away."""
        if item in answered:
            self._num_resumed += 1
            self._progress.update(1)
            return None
        if isinstance(item, LineError):
            if item.code == DUPLICATE_CUSTOM_ID:
                logger.warning("%s", item.message)
                self._num_duplicates += 1
            self._write(line_error_record(item), failed=True)
            return None
        response_id = self._translator.response_id(item)
        try:
            return self._translator.translate(item, response_id)
        except APIError as error:
            self._write_response(item, response_id, error.status_code, error.to_body())
        except Exception as error:
            # A bug this line's content hit: it gets a 500, as from the server, and the run goes
            # on; ending it would lose the records of every line in flight.
            self._write_unexpected(item, response_id, "preparing", error)
        return None

    @property
    def _in_flight_ids(self) -> list[str]:
        """Every engine request in flight: lines' prompts and beam searches' steps."""
        return [*self._pending, *(self._beams.request_ids if self._beams else ())]

    @property
    def _num_in_flight(self) -> int:
        return len(self._in_flight_ids)

    def _submit(self, ready: ReadyLine) -> None:
        assert self._engine is not None and ready.prepared is not None
        if ready.prepared.beam_search is not None:
            self._submit_beam_search(ready)
            return
        prompts = ready.prepared.prompts
        pending = _Pending(ready, now_s(), [None] * len(prompts), len(prompts))
        added: list[str] = []
        for index, prompt in enumerate(prompts):
            request_id = f"{ready.response_id}-{index}"
            try:
                self._engine.add_request(
                    request_id,
                    prompt.token_ids,
                    ready.prepared.params,
                    prompt.text,
                    lora_request=ready.prepared.lora_request,
                    priority=ready.prepared.priority,
                )
            except Exception as error:
                for added_id in added:
                    self._engine.abort_request(added_id)
                    del self._pending[added_id]
                self._write_adding_error(
                    ready, error, f"prompt {index}: " if len(prompts) > 1 else ""
                )
                return
            added.append(request_id)
            self._pending[request_id] = (pending, index)
        self._note_in_flight(self._num_in_flight)

    def _submit_beam_search(self, ready: ReadyLine) -> None:
        assert self._beams is not None and ready.prepared is not None
        try:
            results = self._beams.start(ready, ready.response_id, ready.prepared)
        except Exception as error:
            self._write_adding_error(ready, error)
            return
        if results is not None:
            self._answer(ready, now_s(), results)
        self._note_in_flight(self._num_in_flight)

    def _write_adding_error(self, ready: ReadyLine, error: Exception, where: str = "") -> None:
        """A 400 for what the engine refused (as the server answers), else a 500."""
        if not isinstance(error, ValueError):
            self._write_unexpected(ready.line, ready.response_id, "adding", error)
            return
        body = refused_by_engine(error, where).to_body()
        self._write_response(ready.line, ready.response_id, 400, body)

    @property
    def _num_buffered(self) -> int:
        return sum(ready.size for ready in self._pooling_buffer)

    def _note_in_flight(self, num_in_flight: int) -> None:
        self._peak_in_flight = max(self._peak_in_flight, num_in_flight)

    # ------------------------------------------------------------ results out
    def _flush_pooling(self) -> None:
        if not self._pooling_buffer:
            return
        buffer, self._pooling_buffer = self._pooling_buffer, []
        for ready, result in zip(buffer, self._run_pooling(buffer), strict=True):
            if isinstance(result, APIError):
                status, body = result.status_code, result.to_body()
            else:
                status, body = 200, result
            self._write_response(ready.line, ready.response_id, status, body)

    def _run_pooling(self, buffer: list[ReadyLine]) -> list[dict[str, Any] | APIError]:
        """Each buffered line's response body, or its 400, or a 500 for a line that fails
        alone (the others still get their answers)."""
        prepared = [ready.pooling for ready in buffer if ready.pooling is not None]
        return run_pooling_apart_on_failure(
            self._pooling,
            prepared,
            lambda index, error: _unexpected_error(buffer[index].line, "running", error),
        )

    def _on_output(self, output: RequestOutput) -> None:
        if self._beams is not None and self._beams.owns(output.request_id):
            self._on_beam_output(output)
            return
        pending, index = self._pending.pop(output.request_id)
        ready = pending.ready
        assert ready.prepared is not None
        prompt = ready.prepared.prompts[index]
        pending.results[index] = PromptResult.from_final_output(prompt, output)
        pending.num_unfinished -= 1
        if pending.num_unfinished:
            return
        self._answer(ready, pending.created, [r for r in pending.results if r is not None])

    def _on_beam_output(self, output: RequestOutput) -> None:
        assert self._beams is not None
        end = self._beams.on_output(output)
        if end is None:
            return
        if end.error is not None:
            self._write_adding_error(end.line, end.error)
        else:
            assert end.results is not None
            self._answer(end.line, now_s(), end.results)

    def _answer(self, ready: ReadyLine, created: int, results: list[PromptResult]) -> None:
        assert ready.prepared is not None
        body = generation_body(
            ready.response_id,
            created,
            self._model_name,
            ready.prepared,
            results,
            self._decode_token,
        )
        self._num_output_tokens += body["usage"]["completion_tokens"]
        self._write_response(ready.line, ready.response_id, 200, body)

    def _write_unexpected(
        self, line: BatchLine, response_id: str, doing: str, error: Exception
    ) -> None:
        error_body = _unexpected_error(line, doing, error).to_body()
        self._write_response(line, response_id, 500, error_body)

    def _write_response(
        self, line: BatchLine, request_id: str, status_code: int, body: dict[str, Any]
    ) -> None:
        record = response_record(line, request_id, status_code, body)
        self._write(record, failed=status_code != 200)

    def _write(self, record: dict[str, Any], failed: bool) -> None:
        self._writer.write(record)
        self._num_answered += 1
        self._num_failed += failed
        self._progress.update(1)
        elapsed_s = self._progress.format_dict["elapsed"] or 1e-9
        self._progress.set_postfix_str(
            f"{self._num_output_tokens / elapsed_s:.1f} out tok/s", refresh=False
        )


def _unexpected_error(line: BatchLine, doing: str, error: Exception) -> APIError:
    """A 500 for an exception no check expected (a bug), logged with its traceback."""
    logger.error(
        "line %d (custom_id %r): unexpected error %s it",
        line.line_number,
        line.custom_id,
        doing,
        exc_info=error,
    )
    return internal_error(error)


def run_batch(llm: LLM, options: BatchOptions) -> BatchSummary:
    """Answers the batch file; resumes an earlier run's output, refuses any other file there."""
    check_input_file(options.input_path)
    writer, answered = open_batch_output(options)
    try:
        return BatchRunner(llm, options).run(writer, answered)
    finally:
        writer.close()


def run_batch_command(model: str, engine_kwargs: dict[str, Any], options: BatchOptions) -> int:
    """`vacpack run-batch`: check the files, load the model, answer the file, report."""
    # The files first: a missing input or an output that must not be touched fails in a moment,
    # not after the model has loaded.
    check_input_file(options.input_path)
    writer, answered = open_batch_output(options)
    try:
        llm = LLM(model, **engine_kwargs)
        runner = BatchRunner(llm, options)
        freeze_startup_objects()  # the process runs this file and exits
        summary = runner.run(writer, answered)
    finally:
        writer.close()
    print(
        f"{summary.num_answered} requests answered ({summary.num_failed} with errors, "
        f"{summary.num_duplicates} of them repeated custom_ids), {summary.num_resumed} already "
        f"answered; {summary.num_output_tokens} output tokens in {summary.elapsed_s:.1f} s "
        f"({summary.num_output_tokens / max(summary.elapsed_s, 1e-9):.1f} tok/s) -> "
        f"{options.output_path}",
        file=sys.stderr,
    )
    if llm.loaded.is_decoder:  # the engine exists: BatchRunner built it
        state = llm.engine.state()
        print(
            f"memory pressure: {state.num_preemptions} preemptions; "
            f"{state.describe_prefix_cache()}",
            file=sys.stderr,
        )
    # Only a run that generated has a step timeline; asking an embedding-only run for its
    # engine would build one (and its KV cache) just to report nothing.
    timeline = getattr(llm.engine, "timeline", None) if summary.num_output_tokens else None
    if timeline is not None:
        print(f"step timeline: {timeline.summary().describe()}", file=sys.stderr)
    return 0
