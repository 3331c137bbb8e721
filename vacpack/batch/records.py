"""The lines of an OpenAI batch output file."""

from __future__ import annotations

import uuid
from typing import Any

from vacpack.batch.lines import LineError


def response_record(
    custom_id: str, request_id: str, status_code: int, body: dict[str, Any]
) -> dict[str, Any]:
    """A request that was answered: with a response body, or an error body and its status."""
    return {
        "id": _record_id(),
        "custom_id": custom_id,
        "response": {"status_code": status_code, "request_id": request_id, "body": body},
        "error": None,
    }


def line_error_record(error: LineError) -> dict[str, Any]:
    """A line that is not a request at all. `line` lets a resumed run recognise it."""
    return {
        "id": _record_id(),
        "custom_id": error.custom_id,
        "response": None,
        "error": {"code": "invalid_request", "message": error.message, "line": error.line_number},
    }


def _record_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"
