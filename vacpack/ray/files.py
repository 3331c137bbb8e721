"""Corpus files in and results out through Ray Data: JSONL, Parquet or plain text, local paths
or any filesystem Ray Data reads (s3://, gs://, ...), read and written by the cluster's nodes.

JSON Lines are read as lines and parsed here, one line at a time, rather than by Ray Data's
JSON reader, which fails the whole job at the first malformed line: a line that is not a JSON
object becomes a row with only its reason set (READ_ERROR_COLUMN), which the job writes out
as the row's `error`, as the single-process commands do.

Ray Data's reading and writing tasks import this module in worker processes of their own: it
stays light (pyarrow, Ray and the standard library; no torch or transformers), else each of
them spends seconds importing, all at once on the same cores.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import pyarrow as pa
import ray

from vacpack.corpus.input_fields import is_blank_line, parse_json_object

# Why a row of the input could not be read (a malformed JSON line): set here, taken by the
# actor into the row's error, and not written out.
READ_ERROR_COLUMN = "_vacpack_read_error"
JSON_LINES_SUFFIX = ".jsonl"
JSON_SUFFIX = ".json"  # a JSON document (or JSON Lines), read by Ray Data's JSON reader
# Characters of a malformed line quoted in its error.
LINE_EXCERPT_CHARS = 80
BYTE_ORDER_MARK = "\ufeff"  # UTF-8's, decoded
PARQUET_SUFFIX = ".parquet"
OUTPUT_FORMATS = ("jsonl", "parquet")
# Reading and writing take no CPU slot, so that they are not queued behind the one CPU the
# replicas leave free (Ray Data's file listing still takes it); what they do (parse,
# compress) is small beside the model's work on the same cores.
IO_TASK_CPUS = 0
# pandas writes Ray Data's JSON with 10 decimal places unless told: too few for a float32
# embedding component near zero.
JSON_DOUBLE_PRECISION = 15


def read_dataset(path: str, min_num_blocks: int) -> ray.data.Dataset:
    """A dataset of the input: JSON objects (.jsonl/.json), Parquet (.parquet, or a directory
    of them), else plain text, one row per line (empty lines kept, so that rows match lines).

    A small input is split into `min_num_blocks` blocks, so that every replica gets some; a
    large one comes in more, as Ray Data splits what outgrows its target block size.
    """
    stripped = path.rstrip("/")
    if stripped.endswith(JSON_LINES_SUFFIX):
        lines = ray.data.read_text(
            path,
            drop_empty_lines=True,
            num_cpus=IO_TASK_CPUS,
            override_num_blocks=min_num_blocks,
        )
        return lines.map_batches(
            drop_blank_lines, batch_format="pyarrow", num_cpus=IO_TASK_CPUS
        ).map_batches(
            parse_json_lines,
            batch_format="pyarrow",
            num_cpus=IO_TASK_CPUS,
            udf_modifying_row_count=False,
        )
    if stripped.endswith(JSON_SUFFIX):
        return ray.data.read_json(path, num_cpus=IO_TASK_CPUS, override_num_blocks=min_num_blocks)
    if stripped.endswith(PARQUET_SUFFIX) or _is_parquet_directory(path):
        dataset = ray.data.read_parquet(
            path, num_cpus=IO_TASK_CPUS, override_num_blocks=min_num_blocks
        )
        if stripped.endswith(PARQUET_SUFFIX):
            # A file is read in whole row groups, and a small one often holds one: it would
            # come as one block, and one replica would run the whole job. Split in order.
            dataset = dataset.repartition(min_num_blocks)
        return dataset
    return ray.data.read_text(
        path,
        drop_empty_lines=False,
        num_cpus=IO_TASK_CPUS,
        override_num_blocks=min_num_blocks,
    )


def drop_blank_lines(lines: pa.Table) -> pa.Table:
    """The rows of Ray Data's text lines that are not blank as every reader here counts blank
    (input_fields.is_blank_line): read_text drops lines of only whitespace, and keeps one of
    only a byte-order mark."""
    keep = [not is_blank_line(line.encode("utf-8")) for line in lines.column("text").to_pylist()]
    return lines.filter(pa.array(keep, type=pa.bool_()))


def parse_json_lines(lines: pa.Table) -> pa.Table:
    """Ray Data's text rows (column `text`, one line each) parsed as JSON objects: one row per
    line, the objects' keys as columns, and READ_ERROR_COLUMN saying why a line is not a JSON
    object (null for the others)."""
    records: list[dict] = []
    errors: list[str | None] = []
    for line in lines.column("text").to_pylist():
        # A file's byte-order mark, which the text reader keeps on its first line.
        record = parse_json_object(line.removeprefix(BYTE_ORDER_MARK))
        if isinstance(record, dict):
            records.append(record)
            errors.append(None)
        else:
            records.append({})
            excerpt = line if len(line) <= LINE_EXCERPT_CHARS else line[:LINE_EXCERPT_CHARS] + "..."
            errors.append(f"the line {record} ({excerpt})")
    # Every key of any line is a column (Table.from_pylist would take the first line's only).
    names = dict.fromkeys(name for record in records for name in record)
    columns = {name: _one_type_column(name, records, errors) for name in names}
    columns[READ_ERROR_COLUMN] = pa.array(errors, type=pa.string())
    return pa.table(columns)


def _one_type_column(name: str, records: list[dict], errors: list[str | None]) -> pa.Array:
    """The key's values as one Arrow column. Arrow holds one type per column, where JSON lines
    may mix them (an id that is a number on one line and a string on the next): the block's
    most common kind keeps its values, and a line of another kind fails with the reason (set
    in `errors`) rather than failing the whole block."""
    values = [record.get(name) for record in records]
    try:
        return pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        pass
    kinds = [_json_kind(value) for value in values]
    common = Counter(kind for kind in kinds if kind is not None).most_common(1)[0][0]
    kept: list[Any] = []
    for row, (value, kind) in enumerate(zip(values, kinds, strict=True)):
        if kind in (None, common):
            kept.append(value)
            continue
        kept.append(None)
        if errors[row] is None:
            errors[row] = (
                f"the line's {name!r} is {kind} where other lines of its block have {common}: "
                "under --ray a key holds one type"
            )
    try:
        return pa.array(kept)
    except (pa.ArrowInvalid, pa.ArrowTypeError):  # same kinds, different insides
        for row, value in enumerate(kept):
            if value is not None and errors[row] is None:
                errors[row] = (
                    f"the line's {name!r} does not share one type with the other lines of its "
                    "block (lists or objects whose items differ in type)"
                )
        return pa.nulls(len(kept))


def _json_kind(value: Any) -> str | None:
    """A JSON value's kind, in words; None for null."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "a list" if isinstance(value, list) else "an object"


def output_format(path: str, given: str | None) -> str:
    if given is not None:
        if given not in OUTPUT_FORMATS:
            raise ValueError(f"the output format must be one of {OUTPUT_FORMATS}, got {given!r}")
        return given
    return "parquet" if path.rstrip("/").endswith(PARQUET_SUFFIX) else "jsonl"


def write_dataset(dataset: ray.data.Dataset, path: str, file_format: str) -> None:
    """Writes a directory of files, one per written block; with order preserved, their names
    sort in input order."""
    if file_format == "parquet":
        dataset.write_parquet(path, ray_remote_args={"num_cpus": IO_TASK_CPUS})
    else:
        dataset.write_json(
            path,
            ray_remote_args={"num_cpus": IO_TASK_CPUS},
            double_precision=JSON_DOUBLE_PRECISION,
            force_ascii=False,
        )


def _is_parquet_directory(path: str) -> bool:
    return os.path.isdir(path) and any(name.endswith(PARQUET_SUFFIX) for name in os.listdir(path))
