"""What each actor of a Ray Data job runs: one vacpack LLM, one packed call per batch.

Every class here is a callable class for `ray.data.Dataset.map_batches` over pyarrow batches
(`batch_format="pyarrow"`), shaped like Ray Data's LLM processors: the batch's columns come
out unchanged, with the task's result columns and an `error` column added (null where the row
succeeded). A row that cannot be read or run gets its reason there; the other rows, and the
job, go on.

    ds.map_batches(
        EmbedActor,
        fn_constructor_kwargs={"model": "sentence-transformers/all-MiniLM-L6-v2"},
        compute=ray.data.ActorPoolStrategy(size=4),
        batch_format="pyarrow",
        batch_size=1024,
        num_cpus=8,
    )

`vacpack.ray.build_processor` makes that call from a ProcessorConfig.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import pyarrow as pa
import ray
import torch

from vacpack.corpus.input_fields import TEXT_KEYS
from vacpack.corpus.packing import DocumentError
from vacpack.host_memory import host_peak_memory_bytes
from vacpack.llm import LLM
from vacpack.ray.columns import (
    ERROR_COLUMN,
    MESSAGES_COLUMN,
    SAMPLING_PARAMS_COLUMN,
    RowError,
    chat_prompt,
    column_values,
    first_present,
    per_row,
    text_or_token_ids,
    with_columns,
)
from vacpack.ray.figures import BatchWork, ReplicaFigures, this_replica
from vacpack.ray.files import READ_ERROR_COLUMN
from vacpack.sampling import SamplingParams


class _ModelActor:
    """One LLM per actor; running figures sent to a FiguresCollector after each batch.

    Ray Data calls an actor with one batch at a time, so what `_read_rows` learns of a batch
    (whether it has continuations, each row's sampling parameters) waits on the actor for
    `_run` and `_result_columns`.
    """

    task_name: ClassVar[str]

    def __init__(
        self,
        model: str,
        engine_kwargs: Mapping[str, Any] | None = None,
        input_column: str | None = None,
        figures_collector: Any | None = None,
    ) -> None:
        start_s = time.perf_counter()
        self.llm = LLM(model, **dict(engine_kwargs or {}))
        self.input_column = input_column
        self._collector = figures_collector
        host, pid = this_replica()
        self.figures = ReplicaFigures(host, pid, self.task_name, time.perf_counter() - start_s)
        self._first_batch_start_s: float | None = None

    def __call__(self, batch: pa.Table) -> pa.Table:
        start_s = time.perf_counter()
        if self._first_batch_start_s is None:
            self._first_batch_start_s = start_s
        # Rows that could not be read (a malformed JSON line) fail with the reader's reason.
        errors: list[str | None] = [None] * batch.num_rows
        if READ_ERROR_COLUMN in batch.column_names:
            errors = column_values(batch, READ_ERROR_COLUMN)
            batch = batch.drop_columns([READ_ERROR_COLUMN])
        self._note_columns(batch.column_names)
        valid: list[tuple[int, Any]] = []
        if any(error is None for error in errors):
            for row, item in enumerate(self._read_rows(batch)):
                if errors[row] is not None:
                    continue
                if isinstance(item, RowError):
                    errors[row] = str(item)
                else:
                    valid.append((row, item))
        results, work = self._run([item for _, item in valid]) if valid else ([], _NO_WORK)
        per_row: list[Any] = [None] * batch.num_rows
        for (row, _), result in zip(valid, results, strict=True):
            if isinstance(result, DocumentError):
                errors[row] = result.message
            else:
                per_row[row] = result
        columns = self._result_columns(per_row)
        columns[ERROR_COLUMN] = pa.array(errors, type=pa.string())
        num_failed = sum(error is not None for error in errors)
        span_s = time.perf_counter() - self._first_batch_start_s
        self.figures = self.figures.with_batch(
            batch.num_rows, num_failed, work, span_s, _peak_memory_bytes(self.llm)
        )
        if self._collector is not None:
            # Waited for, so that the driver reads every batch's figures once the job is done.
            ray.get(self._collector.record.remote(self.figures))
        return with_columns(batch, columns)

    # ------------------------------------------------------------ each task's own part
    def _note_columns(self, names: list[str]) -> None:
        """What the batch's columns say about its results, noted for every batch (also one
        whose rows all failed to read), so that nothing carries over from the one before."""

    def _read_rows(self, batch: pa.Table) -> list[Any]:
        """The batch's model inputs, one per row, or a RowError for a row that has none."""
        column = self.input_column or first_present(batch, TEXT_KEYS)
        return [text_or_token_ids(value, column) for value in column_values(batch, column)]

    def _run(self, inputs: list[Any]) -> tuple[list[Any], BatchWork]:
        """Results in input order (a DocumentError for an input that failed) and their cost."""
        raise NotImplementedError

    def _result_columns(self, results: list[Any]) -> dict[str, pa.Array]:
        """The task's output columns; a failed row (None) is null in each."""
        raise NotImplementedError

    # ------------------------------------------------------------ shared
    def _run_corpus_job(self, call: Callable[[], list[Any]]) -> tuple[list[Any], BatchWork]:
        """Runs `call` (one LLM corpus method over the batch) and reads its job report."""
        results = call()
        report = self.llm.corpus_runner.last_report
        assert report is not None, "a job that ran left its report"
        work = BatchWork(
            num_real_tokens=report.num_real_tokens,
            num_padding_tokens=report.num_padding_tokens,
            num_bins=report.num_bins,
            device_busy_s=report.device_busy_s,
            elapsed_s=report.elapsed_s,
        )
        return results, work

    def _run_on_engine(self, call: Callable[[], list[Any]]) -> tuple[list[Any], BatchWork]:
        """Runs `call` (one LLM call through the generation engine) and reads its timeline."""
        timeline = self.llm.engine.timeline
        before = timeline.summary()
        start_s = time.perf_counter()
        results = call()
        elapsed_s = time.perf_counter() - start_s
        after = timeline.summary()
        tokens_before = before.num_prefill_tokens + before.num_decode_tokens
        work = BatchWork(
            num_real_tokens=after.num_prefill_tokens + after.num_decode_tokens - tokens_before,
            num_padding_tokens=after.num_padded_slots - before.num_padded_slots,
            num_bins=after.num_steps - before.num_steps,
            device_busy_s=after.device_busy_s - before.device_busy_s,
            elapsed_s=elapsed_s,
        )
        return results, work


_NO_WORK = BatchWork(0, 0, 0, 0.0, 0.0)


class EmbedActor(_ModelActor):
    """Adds `embedding` (list of float32) per row, from the text in `input_column`; the
    options are LLM.embed's."""

    task_name = "embed"

    def __init__(
        self,
        model: str,
        engine_kwargs: Mapping[str, Any] | None = None,
        input_column: str | None = None,
        figures_collector: Any | None = None,
        pooling: str | None = None,
        normalize: bool | None = None,
        truncate: bool = False,
        dimensions: int | None = None,
        prompt: str | None = None,
        prompt_name: str | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> None:
        super().__init__(model, engine_kwargs, input_column, figures_collector)
        self.pooling, self.normalize, self.truncate = pooling, normalize, truncate
        self.truncate_prompt_tokens = truncate_prompt_tokens
        self.dimensions, self.prompt, self.prompt_name = dimensions, prompt, prompt_name

    def _run(self, inputs: list[Any]) -> tuple[list[Any], BatchWork]:
        return self._run_corpus_job(
            lambda: self.llm.embed(
                inputs,
                pooling=self.pooling,
                normalize=self.normalize,
                truncate=self.truncate,
                dimensions=self.dimensions,
                prompt=self.prompt,
                prompt_name=self.prompt_name,
                truncate_prompt_tokens=self.truncate_prompt_tokens,
                use_tqdm=False,
                return_failures=True,
            )
        )

    def _result_columns(self, results: list[Any]) -> dict[str, pa.Array]:
        vectors = per_row(results, lambda r: r.outputs.embedding)
        return {"embedding": pa.array(vectors, type=pa.list_(pa.float32()))}


class ClassifyActor(_ModelActor):
    """Adds `label` and `probs` (a struct: one probability per label name) per row."""

    task_name = "classify"

    def __init__(
        self,
        model: str,
        engine_kwargs: Mapping[str, Any] | None = None,
        input_column: str | None = None,
        figures_collector: Any | None = None,
        truncate: bool = False,
        truncate_prompt_tokens: int | None = None,
    ) -> None:
        super().__init__(model, engine_kwargs, input_column, figures_collector)
        from vacpack.corpus.tasks import ClassifyTask

        # Also fails here, at start-up, for a model without a classification head.
        labels = ClassifyTask(self.llm.loaded).labels
        self._probs_type = pa.struct([(label, pa.float64()) for label in labels])
        self.truncate, self.truncate_prompt_tokens = truncate, truncate_prompt_tokens

    def _run(self, inputs: list[Any]) -> tuple[list[Any], BatchWork]:
        return self._run_corpus_job(
            lambda: self.llm.classify(
                inputs,
                truncate=self.truncate,
                truncate_prompt_tokens=self.truncate_prompt_tokens,
                use_tqdm=False,
                return_failures=True,
            )
        )

    def _result_columns(self, results: list[Any]) -> dict[str, pa.Array]:
        probs = per_row(
            results, lambda r: dict(zip(r.outputs.labels, r.outputs.probs, strict=True))
        )
        return {
            "label": pa.array(per_row(results, lambda r: r.outputs.label), type=pa.string()),
            "probs": pa.array(probs, type=self._probs_type),
        }


class LoglikelihoodActor(_ModelActor):
    """Adds `logprob` and `num_tokens` per row: of the text in `input_column` (rolling), or,
    where the batch has `context` and `continuation` columns, of each continuation after its
    context (then also `is_greedy`). `token_logprobs` too when asked."""

    task_name = "loglikelihood"

    def __init__(
        self,
        model: str,
        engine_kwargs: Mapping[str, Any] | None = None,
        input_column: str | None = None,
        figures_collector: Any | None = None,
        return_token_logprobs: bool = False,
        truncate: bool = False,
    ) -> None:
        super().__init__(model, engine_kwargs, input_column, figures_collector)
        self.return_token_logprobs = return_token_logprobs
        self.truncate = truncate
        self._has_continuations = False

    def _note_columns(self, names: list[str]) -> None:
        self._has_continuations = (
            self.input_column is None and "context" in names and "continuation" in names
        )

    def _read_rows(self, batch: pa.Table) -> list[Any]:
        if not self._has_continuations:
            return super()._read_rows(batch)
        contexts = column_values(batch, "context")
        pairs = zip(contexts, column_values(batch, "continuation"), strict=True)
        return [
            (context, continuation)
            if isinstance(context, str) and isinstance(continuation, str)
            else RowError("'context' and 'continuation' must both be strings")
            for context, continuation in pairs
        ]

    def _run(self, inputs: list[Any]) -> tuple[list[Any], BatchWork]:
        if not self._has_continuations:
            return self._run_corpus_job(lambda: self._score(inputs, None))
        contexts = [context for context, _ in inputs]
        continuations = [continuation for _, continuation in inputs]

        def score() -> list[Any]:
            return self._score(contexts, continuations)

        # LLM.loglikelihood scores continuations through the engine's prefix cache when it is
        # on (shared contexts computed once), else in packed bins.
        if self.llm.config.enable_prefix_caching:
            return self._run_on_engine(score)
        return self._run_corpus_job(score)

    def _score(self, texts_or_contexts: list[str], continuations: list[str] | None) -> list[Any]:
        return self.llm.loglikelihood(
            texts_or_contexts,
            continuations,
            return_token_logprobs=self.return_token_logprobs,
            truncate=self.truncate,
            use_tqdm=False,
            return_failures=True,
        )

    def _result_columns(self, results: list[Any]) -> dict[str, pa.Array]:
        columns = {
            "logprob": pa.array(per_row(results, lambda r: r.logprob), pa.float64()),
            "num_tokens": pa.array(per_row(results, lambda r: r.num_tokens), pa.int64()),
        }
        if self._has_continuations:
            columns["is_greedy"] = pa.array(per_row(results, lambda r: r.is_greedy), pa.bool_())
        if self.return_token_logprobs:
            per_token = per_row(results, lambda r: r.token_logprobs)
            columns["token_logprobs"] = pa.array(per_token, pa.list_(pa.float64()))
        return columns


class GenerateActor(_ModelActor):
    """Adds `generated_text`, `finish_reason`, `num_input_tokens` and `num_generated_tokens`
    per row, from the prompt in `input_column` or a chat `messages` column.

    `sampling_params` (a SamplingParams or a dict of its fields) applies to every row; a row's
    own `sampling_params` column, where present, overrides the fields it sets. One completion
    per row (`n` = 1): give each sample a row of its own.
    """

    task_name = "generate"

    def __init__(
        self,
        model: str,
        engine_kwargs: Mapping[str, Any] | None = None,
        input_column: str | None = None,
        figures_collector: Any | None = None,
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(model, engine_kwargs, input_column, figures_collector)
        if isinstance(sampling_params, Mapping):
            sampling_params = SamplingParams(**sampling_params)
        self.sampling_params = sampling_params or SamplingParams()
        check_one_completion(self.sampling_params)
        self._params: list[SamplingParams] = []

    def _read_rows(self, batch: pa.Table) -> list[Any]:
        if self.input_column is None and MESSAGES_COLUMN in batch.column_names:
            tokenizer = self.llm.get_tokenizer()
            conversations = column_values(batch, MESSAGES_COLUMN)
            prompts = [chat_prompt(tokenizer, messages) for messages in conversations]
        else:
            prompts = super()._read_rows(batch)
        overrides = (
            column_values(batch, SAMPLING_PARAMS_COLUMN)
            if SAMPLING_PARAMS_COLUMN in batch.column_names
            else [None] * batch.num_rows
        )
        rows: list[Any] = []
        self._params = []
        for prompt, override in zip(prompts, overrides, strict=True):
            try:
                if isinstance(prompt, RowError):
                    raise prompt
                params = self._row_params(override)
                rows.append(self._validated(prompt))
                self._params.append(params)
            except RowError as error:
                rows.append(error)
        return rows

    def _row_params(self, override: Mapping[str, Any] | None) -> SamplingParams:
        if not override:
            return self.sampling_params
        given = {name: value for name, value in override.items() if value is not None}
        try:
            params = dataclasses.replace(self.sampling_params, **given)
        except (TypeError, ValueError) as error:
            raise RowError(f"bad {SAMPLING_PARAMS_COLUMN}: {error}") from None
        try:
            check_one_completion(params)
        except ValueError as error:
            raise RowError(str(error)) from None
        return params

    def _validated(self, prompt: str | list[int]) -> dict[str, Any]:
        """Encodes and checks a prompt here, so that a bad one fails its row only (LLM.generate
        would refuse the whole batch)."""
        if isinstance(prompt, str):
            text, token_ids = prompt, self.llm.get_tokenizer().encode(prompt)
        else:
            text, token_ids = None, prompt
        try:
            self.llm.engine.validate_prompt(token_ids)
        except ValueError as error:
            raise RowError(str(error)) from None
        return {"prompt": text, "prompt_token_ids": token_ids}

    def _run(self, inputs: list[Any]) -> tuple[list[Any], BatchWork]:
        return self._run_on_engine(lambda: self.llm.generate(inputs, self._params, use_tqdm=False))

    def _result_columns(self, results: list[Any]) -> dict[str, pa.Array]:
        return {
            "generated_text": pa.array(per_row(results, lambda r: r.outputs[0].text), pa.string()),
            "finish_reason": pa.array(
                per_row(results, lambda r: r.outputs[0].finish_reason), pa.string()
            ),
            "num_input_tokens": pa.array(
                per_row(results, lambda r: len(r.prompt_token_ids)), pa.int64()
            ),
            "num_generated_tokens": pa.array(
                per_row(results, lambda r: len(r.outputs[0].token_ids)), pa.int64()
            ),
        }


ACTORS: Mapping[str, type[_ModelActor]] = {
    "embed": EmbedActor,
    "classify": ClassifyActor,
    "loglikelihood": LoglikelihoodActor,
    "generate": GenerateActor,
}


# ---------------------------------------------------------------- helpers
def check_one_completion(params: SamplingParams) -> None:
    if params.n != 1:
        raise ValueError(f"n={params.n}: one completion per row; give each sample its own row")


def _peak_memory_bytes(llm: LLM) -> int:
    device = llm.loaded.device
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return host_peak_memory_bytes()
