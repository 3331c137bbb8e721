"""Reading JSON records wherever they are read (corpus and prompt files, Ray Data columns):
a line's object, and which of its fields holds a document's text."""

from __future__ import annotations

import json
from typing import Any

TEXT_KEYS = ("text", "input", "prompt")


def parse_json_object(line: str) -> dict[str, Any] | str:
    """A JSON line's object, or what is wrong with the line, worded to follow "line N"."""
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, RecursionError) as error:
        return f"is not valid JSON: {error}"
    if not isinstance(record, dict):
        return "is not a JSON object"
    return record
