"""The results file of a batch run: what an earlier run answered, and whether a file is one.

An existing output is resumed only if every whole line is a batch output record whose
custom_id (or, for a line without one, whose input line number) the input file has, on a line
unchanged since the record was written (records.py); anything else is refused untouched (see
vacpack/output_file.py): an edited request must not keep the answer to what it was. Records
are appended whole, so a run killed at any moment leaves at most its last line torn; that tail
is cut off on resume and its request answered again: every custom_id ends up answered exactly
once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vacpack.batch.lines import BatchLine, LineError, iter_lines
from vacpack.batch.options import BatchOptions
from vacpack.batch.records import RECORD_ID_PREFIX, answered_line_digest
from vacpack.output_file import ResultWriter, open_output

# How every record line starts: records.py builds the "id" first and writes compact JSON.
BATCH_RECORD_START = b'{"id":"' + RECORD_ID_PREFIX.encode()
_RECORD_KEYS = frozenset({"id", "custom_id", "response", "error"})


@dataclass
class AnsweredSet:
    """Requests with a result line. Holds ids only (not results), one small string per line."""

    custom_ids: set[str] = field(default_factory=set)
    # Input lines without a usable custom_id are known by their line number instead.
    line_numbers: set[int] = field(default_factory=set)

    def __len__(self) -> int:
        return len(self.custom_ids) + len(self.line_numbers)

    def __contains__(self, item: BatchLine | LineError) -> bool:
        if item.custom_id is not None:
            return item.custom_id in self.custom_ids
        return item.line_number in self.line_numbers

    def add_record(self, record: dict[str, Any]) -> None:
        custom_id = record.get("custom_id")
        if isinstance(custom_id, str):
            self.custom_ids.add(custom_id)
            return
        error = record.get("error") or {}
        if isinstance(error.get("line"), int):
            self.line_numbers.add(error["line"])


@dataclass(frozen=True)
class _InputKeys:
    """What identifies the input's requests (custom_ids, and line numbers of lines without
    one), each with the digest of its line."""

    custom_ids: dict[str, str]
    unnamed_line_numbers: dict[int, str]

    @classmethod
    def read(cls, path: Path) -> _InputKeys:
        custom_ids: dict[str, str] = {}
        unnamed: dict[int, str] = {}
        for item in iter_lines(path):
            if item.custom_id is not None:
                custom_ids[item.custom_id] = item.digest
            else:
                unnamed[item.line_number] = item.digest
        return cls(custom_ids, unnamed)

    def problem(self, record: dict[str, Any]) -> str | None:
        if set(record) != _RECORD_KEYS or not isinstance(record["id"], str):
            return "is not a batch output record"
        digest = answered_line_digest(record["id"])
        custom_id = record["custom_id"]
        if isinstance(custom_id, str):
            if custom_id not in self.custom_ids:
                return f"answers custom_id {custom_id!r}, which the input does not have"
            if digest != self.custom_ids[custom_id]:
                return f"answers custom_id {custom_id!r}, whose line in the input has changed since"
            return None
        error = record["error"]
        line_number = error.get("line") if custom_id is None and isinstance(error, dict) else None
        if not isinstance(line_number, int) or line_number not in self.unnamed_line_numbers:
            return "answers no line of the input"
        if digest != self.unnamed_line_numbers[line_number]:
            return f"answers input line {line_number}, which has changed since"
        return None


def open_batch_output(options: BatchOptions) -> tuple[ResultWriter, AnsweredSet]:
    """The output, ready to append to, and what an earlier run in it answered already."""
    answered = AnsweredSet()
    input_keys: list[_InputKeys] = []  # read from the input only if there is an output to check

    def check_record(record: dict[str, Any]) -> str | None:
        if not input_keys:
            input_keys.append(_InputKeys.read(options.input_path))
        problem = input_keys[0].problem(record)
        if problem is None:
            answered.add_record(record)
        return problem

    writer = open_output(
        options.output_path,
        record_start=BATCH_RECORD_START,
        check_record=check_record,
        overwrite=options.overwrite,
        fsync_interval_s=options.fsync_interval_s,
    )
    return writer, answered
