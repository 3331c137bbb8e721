"""The results file: what an earlier run answered (for resuming), and appends that stay whole.

Each result line goes to the file in one unbuffered write(2) of the complete line, so a run
killed at any moment leaves at most its very last line torn. On resume that torn tail is cut
off and its request is answered again: every custom_id ends up answered exactly once.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vacpack.batch.lines import BatchLine, LineError

logger = logging.getLogger(__name__)


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


def recover_answered(path: Path) -> AnsweredSet:
    """The requests an earlier run answered; a torn or unreadable tail is cut off the file."""
    answered = AnsweredSet()
    if not path.exists():
        return answered
    good_end_bytes = 0
    with path.open("r+b") as results:
        for raw in results:
            record = _whole_record(raw)
            if record is None:
                break
            answered.add_record(record)
            good_end_bytes += len(raw)
        size_bytes = results.seek(0, os.SEEK_END)
        if size_bytes > good_end_bytes:
            logger.warning(
                "%s: cutting off %d bytes after the last whole result line (an interrupted run)",
                path,
                size_bytes - good_end_bytes,
            )
            results.truncate(good_end_bytes)
    return answered


def _whole_record(raw: bytes) -> dict[str, Any] | None:
    if not raw.endswith(b"\n"):
        return None  # the write that would have ended this line never finished
    try:
        record = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return record if isinstance(record, dict) else None


class ResultWriter:
    """Appends result lines: one write(2) per line, fsync at most every `fsync_interval_s`."""

    def __init__(self, path: Path, fsync_interval_s: float) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._fsync_interval_s = fsync_interval_s
        self._last_fsync_s = time.monotonic()

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n"
        data = memoryview(line.encode("utf-8"))
        while data:  # a regular file takes it all at once; the loop is for the rare short write
            data = data[os.write(self._fd, data) :]
        now = time.monotonic()
        if now - self._last_fsync_s >= self._fsync_interval_s:
            os.fsync(self._fd)
            self._last_fsync_s = now

    def close(self) -> None:
        if self._fd < 0:
            return
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = -1

    def __enter__(self) -> ResultWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
