"""Input lines of an OpenAI batch file, read lazily and checked one at a time.

A line that is not a usable request becomes a LineError (answered with an error record), never
an exception that would stop the run. So does a line repeating an earlier line's custom_id:
every custom_id names one request, answered once.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vacpack.corpus.input_fields import is_blank_line, without_byte_order_mark
from vacpack.openai_api.protocol import is_unicode

ENDPOINTS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/score",
    "/score",
    "/v1/rerank",
    "/rerank",
    "/v1/classify",
    "/classify",
    "/v1/pooling",
    "/pooling",
)

_COUNT_CHUNK_BYTES = 1 << 20
# Hex digits of a line's digest (64 bits): plenty to tell an edited line from the one answered.
DIGEST_HEX_CHARS = 16
INVALID_REQUEST = "invalid_request"
# OpenAI's code for this, in the errors of a batch whose input it refuses.
DUPLICATE_CUSTOM_ID = "duplicate_custom_id"


def stream_not_supported(file_kind: str) -> str:
    """Why a line of a file of requests (`file_kind`: "batch files", ...) may not ask to
    stream. A record holds a whole response, so a stream could only be ignored; said, not
    silently done. (A non-boolean "stream" is left to the request's own checks: a 400 naming
    the field.)"""
    return (
        f"stream is not supported in {file_kind} (each record holds a whole response): drop "
        '"stream" or set it to false'
    )


@dataclass(frozen=True)
class BatchLine:
    line_number: int  # 1-based, in the input file
    custom_id: str
    url: str
    body: dict[str, Any]
    digest: str  # line_digest of the line: its record carries it, so a resume can compare


@dataclass(frozen=True)
class LineError:
    line_number: int
    custom_id: str | None  # None when the line has no usable custom_id (or repeats one)
    message: str
    digest: str
    code: str = INVALID_REQUEST


def iter_lines(path: Path) -> Iterator[BatchLine | LineError]:
    """Every non-blank line, parsed, in file order; one line in memory at a time (and one
    short string per custom_id, to find the repeated ones)."""
    first_lines: dict[str, int] = {}  # custom_id -> the line that has it first
    with path.open("rb") as lines:
        for line_number, raw in enumerate(lines, start=1):
            if is_blank_line(raw):
                continue
            item = parse_line(line_number, raw)
            if item.custom_id is None:
                yield item
                continue
            first_line = first_lines.setdefault(item.custom_id, line_number)
            yield item if first_line == line_number else _repeated(item, first_line)


def _repeated(item: BatchLine | LineError, first_line: int) -> LineError:
    """A line whose custom_id an earlier line has. Its error record goes without the custom_id
    (known by its line, as a line without one), so that each custom_id has one record."""
    message = (
        f"line {item.line_number}: custom_id {item.custom_id!r} repeats that of line "
        f"{first_line}; every request needs its own custom_id"
    )
    return LineError(item.line_number, None, message, item.digest, DUPLICATE_CUSTOM_ID)


def line_digest(raw: bytes) -> str:
    """What identifies a line's request, in hex: a digest of its bytes, but for the line end,
    surrounding blanks and a byte-order mark, which a file may gain or lose unchanged."""
    text = without_byte_order_mark(raw).strip()
    return hashlib.blake2b(text, digest_size=DIGEST_HEX_CHARS // 2).hexdigest()


def count_requests(path: Path) -> int:
    """Non-blank lines, counted in fixed-size chunks so a huge file never sits in memory."""
    count = 0
    line_has_text = False
    with path.open("rb") as source:
        while chunk := source.read(_COUNT_CHUNK_BYTES):
            parts = chunk.split(b"\n")
            for index, part in enumerate(parts):
                line_has_text = line_has_text or bool(part.strip())
                if index < len(parts) - 1:  # a newline ends this line
                    count += line_has_text
                    line_has_text = False
    return count + line_has_text


def parse_line(line_number: int, raw: bytes) -> BatchLine | LineError:
    digest = line_digest(raw)
    try:
        record = json.loads(without_byte_order_mark(raw))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        message = f"line {line_number} is not valid JSON: {error}"
        return LineError(line_number, None, message, digest)
    except RecursionError:
        return LineError(line_number, None, f"line {line_number} nests JSON too deeply", digest)
    if not isinstance(record, dict):
        return LineError(line_number, None, f"line {line_number} is not a JSON object", digest)
    custom_id = record.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        message = f"line {line_number} has no custom_id (a non-empty string)"
        return LineError(line_number, None, message, digest)
    if not is_unicode(custom_id):
        # Every record repeats the custom_id, and a lone surrogate cannot be written as UTF-8.
        message = f"line {line_number}: custom_id is not valid Unicode (it holds a lone surrogate)"
        return LineError(line_number, None, message, digest)
    method = record.get("method", "POST")
    url = record.get("url")
    body = record.get("body")
    problem = None
    if method != "POST":
        problem = f"method must be POST, got {method!r}"
    elif url not in ENDPOINTS:
        problem = f"url must be one of {', '.join(ENDPOINTS)}, got {url!r}"
    elif not isinstance(body, dict):
        problem = "body must be a JSON object"
    elif body.get("stream") is True:
        problem = stream_not_supported("batch files")
    if problem is not None:
        return LineError(line_number, custom_id, f"line {line_number}: {problem}", digest)
    assert isinstance(url, str) and isinstance(body, dict)  # checked just above
    return BatchLine(line_number, custom_id, url, body, digest)
