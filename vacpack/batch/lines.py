"""Input lines of an OpenAI batch file, read lazily and checked one at a time.

A line that is not a usable request becomes a LineError (answered with an error record), never
an exception that would stop the run.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
)

_COUNT_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class BatchLine:
    line_number: int  # 1-based, in the input file
    custom_id: str
    url: str
    body: dict[str, Any]


@dataclass(frozen=True)
class LineError:
    line_number: int
    custom_id: str | None  # None when the line has no usable custom_id
    message: str


def iter_lines(path: Path) -> Iterator[BatchLine | LineError]:
    """Every non-blank line, parsed, in file order; one line in memory at a time."""
    with path.open("rb") as lines:
        for line_number, raw in enumerate(lines, start=1):
            if raw.strip():
                yield parse_line(line_number, raw)


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
    try:
        record = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        return LineError(line_number, None, f"line {line_number} is not valid JSON: {error}")
    except RecursionError:
        return LineError(line_number, None, f"line {line_number} nests JSON too deeply")
    if not isinstance(record, dict):
        return LineError(line_number, None, f"line {line_number} is not a JSON object")
    custom_id = record.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return LineError(
            line_number, None, f"line {line_number} has no custom_id (a non-empty string)"
        )
    if not is_unicode(custom_id):
        # Every record repeats the custom_id, and a lone surrogate cannot be written as UTF-8.
        message = f"line {line_number}: custom_id is not valid Unicode (it holds a lone surrogate)"
        return LineError(line_number, None, message)
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
    if problem is not None:
        return LineError(line_number, custom_id, f"line {line_number}: {problem}")
    assert isinstance(url, str) and isinstance(body, dict)  # checked just above
    return BatchLine(line_number, custom_id, url, body)
