"""Reading JSON records wherever they are read (corpus, prompt and batch files, Ray Data
columns): which lines hold one, a line's object, and which of its fields holds a document's
text."""

from __future__ import annotations

import json
from typing import Any

TEXT_KEYS = ("text", "input", "prompt")


def is_blank_line(raw: bytes) -> bool:
    """Whether a line holds only whitespace. Every JSON Lines reader here skips such a line, as
    most JSONL readers do (an editor's trailing empty line is no record, and no error either):
    run-batch, `generate --input`, the corpus commands, and Ray Data's reader under --ray."""
    return not raw.strip()


def parse_json_object(line: str) -> dict[str, Any] | str:
    """A JSON line's object, or what is wrong with the line, worded to follow "line N"."""
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, RecursionError) as error:
        return f"is not valid JSON: {error}"
    if not isinstance(record, dict):
        return "is not a JSON object"
    return record
