"""Result files that never destroy a user's file and never lose finished work.

`open_output` runs before any work starts. It refuses an existing file unless every line is a
record of an earlier run over the same input (the caller says what belongs), cuts the torn last
line an interrupted run may have left, and opens the file for appending, which also proves it
writable. `ResultWriter` then appends each record in one write(2) of the whole line and fsyncs
it, so a crash or a full disk loses at most the record being written: a write that fails
half-way is cut back off the file and the error stops the run.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TextIO

from vacpack.errors import FileAccessError, OutputExistsError

logger = logging.getLogger(__name__)

# Says why a record from an existing output does not belong to this run's input; None if it does.
RecordCheck = Callable[[dict[str, Any]], str | None]


class RecordSink(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def encode_record(record: dict[str, Any]) -> bytes:
    return (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")


class ResultWriter:
    """Appends records to a file: one write(2) per line, fsync at most every `fsync_interval_s`
    (0: after every record)."""

    def __init__(self, path: Path, fsync_interval_s: float = 0.0) -> None:
        self.path = path
        try:
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as error:
            raise FileAccessError("write output file", path, error) from None
        # Pipes and devices (/dev/stdout, /dev/full) can be neither cut back nor fsynced.
        self._is_regular = stat.S_ISREG(os.fstat(self._fd).st_mode)
        self._fsync_interval_s = fsync_interval_s
        self._last_fsync_s = time.monotonic()

    @property
    def is_regular_file(self) -> bool:
        return self._is_regular

    def truncate(self, size_bytes: int) -> None:
        os.ftruncate(self._fd, size_bytes)

    def write(self, record: dict[str, Any]) -> None:
        data = memoryview(encode_record(record))
        size_before = os.fstat(self._fd).st_size if self._is_regular else 0
        try:
            while data:  # a regular file takes it all at once; the loop is for a short write
                data = data[os.write(self._fd, data) :]
            now = time.monotonic()
            if self._is_regular and now - self._last_fsync_s >= self._fsync_interval_s:
                os.fsync(self._fd)
                self._last_fsync_s = now
        except OSError as error:
            if self._is_regular:  # no torn line left behind: its request is answered again
                try:
                    os.ftruncate(self._fd, size_before)
                except OSError:
                    logger.warning("%s: could not cut off a partly written line", self.path)
            raise FileAccessError("write output file", self.path, error) from None

    def close(self) -> None:
        if self._fd < 0:
            return
        fd, self._fd = self._fd, -1
        try:
            if self._is_regular:
                os.fsync(fd)
        finally:
            os.close(fd)

    def __enter__(self) -> ResultWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class StreamWriter:
    """Records to a text stream (standard output when no output file is given)."""

    def __init__(self, stream: TextIO = sys.stdout) -> None:
        self._stream = stream

    def write(self, record: dict[str, Any]) -> None:
        self._stream.write(encode_record(record).decode("utf-8"))
        self._stream.flush()

    def close(self) -> None:
        self._stream.flush()


# Why an input must be a file: every command reads it more than once (to count it, to check an
# earlier output against it, to run it), and a pipe or a terminal gives its lines only once.
_NOT_A_REGULAR_FILE = (
    "not a regular file (a pipe or a device can be read only once, and the input is read "
    "more than once); save it to a file first"
)


def check_input_file(path: Path) -> None:
    """Before any work: the input exists, can be read, and can be read again."""
    try:
        mode = path.stat().st_mode
        # Checked before opening: opening a FIFO would wait for a writer. A directory fails to
        # open below, with its own reason.
        if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
            raise OSError(errno.EINVAL, _NOT_A_REGULAR_FILE)
        with path.open("rb") as source:
            source.read(1)
    except OSError as error:
        raise FileAccessError("read input file", path, error) from None


def open_output(
    path: Path,
    *,
    record_start: bytes,
    check_record: RecordCheck,
    overwrite: bool = False,
    fsync_interval_s: float = 0.0,
) -> ResultWriter:
    """The output, ready to append to, after an existing one was checked to be ours.

    `record_start` is how every line this program writes begins, so a file that starts any
    other way is refused at once, however large. With `overwrite` an existing file is emptied.
    """
    if path.is_dir():
        error = IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR))
        raise FileAccessError("write output file", path, error)
    good_end_bytes = 0
    is_regular = path.is_file()
    if is_regular and not overwrite:
        good_end_bytes = _whole_records_end(path, record_start, check_record)
    writer = ResultWriter(path, fsync_interval_s)
    if is_regular:
        size_bytes = path.stat().st_size
        if overwrite and size_bytes:
            logger.warning("%s: overwriting %d bytes (--overwrite)", path, size_bytes)
            writer.truncate(0)
        elif size_bytes > good_end_bytes:
            logger.warning(
                "%s: cutting off %d bytes after the last whole result line (an interrupted run)",
                path,
                size_bytes - good_end_bytes,
            )
            writer.truncate(good_end_bytes)
    return writer


def _whole_records_end(path: Path, record_start: bytes, check_record: RecordCheck) -> int:
    """Bytes up to the end of the last whole record; OutputExistsError if a line is not ours."""
    good_end_bytes = 0
    with path.open("rb") as results:
        if not _may_start_record(results.read(len(record_start)), record_start):
            raise OutputExistsError(path, "its first line is not a result record")
        results.seek(0)
        for number, raw in enumerate(results, start=1):
            if not raw.endswith(b"\n"):  # the last line, cut short by an interrupted write
                if not _may_start_record(raw, record_start):
                    raise OutputExistsError(path, f"line {number} is not a result record")
                break
            problem = _record_problem(raw, record_start, check_record)
            if problem is not None:
                raise OutputExistsError(path, f"line {number} {problem}")
            good_end_bytes += len(raw)
    return good_end_bytes


def _may_start_record(data: bytes, record_start: bytes) -> bool:
    return data.startswith(record_start) or record_start.startswith(data)


def _record_problem(raw: bytes, record_start: bytes, check_record: RecordCheck) -> str | None:
    if not raw.startswith(record_start):
        return "is not a result record"
    try:
        record = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        return "is not valid JSON"
    if not isinstance(record, dict):
        return "is not a JSON object"
    return check_record(record)
