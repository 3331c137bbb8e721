"""The lines of an OpenAI batch output file.

A record's `id` is "batch_req_" and 32 hex digits: 16 random ones, which keep it unique as
OpenAI's are, then the digest of the input line it answers (lines.line_digest). The id is the
one field of OpenAI's record shape free to carry it, and a resumed run needs it to tell a record
of the line the input has now from one of a line edited since.
"""

from __future__ import annotations

import uuid
from typing import Any

from vacpack.batch.lines import DIGEST_HEX_CHARS, BatchLine, LineError

RECORD_ID_PREFIX = "batch_req_"


def response_record(
    line: BatchLine, request_id: str, status_code: int, body: dict[str, Any]
) -> dict[str, Any]:
    """A request that was answered: with a response body, or an error body and its status."""
    return {
        "id": _record_id(line.digest),
        "custom_id": line.custom_id,
        "response": {"status_code": status_code, "request_id": request_id, "body": body},
        "error": None,
    }


def line_error_record(error: LineError) -> dict[str, Any]:
    """A line that is not a request at all. `line` lets a resumed run recognise it, and is
    where OpenAI's errors for a refused input name the line too."""
    return {
        "id": _record_id(error.digest),
        "custom_id": error.custom_id,
        "response": None,
        "error": {"code": error.code, "message": error.message, "line": error.line_number},
    }


def answered_line_digest(record_id: str) -> str:
    """The digest of the input line that a record (by its id) answers."""
    return record_id[-DIGEST_HEX_CHARS:]


def _record_id(digest: str) -> str:
    return f"{RECORD_ID_PREFIX}{uuid.uuid4().hex[:DIGEST_HEX_CHARS]}{digest}"
