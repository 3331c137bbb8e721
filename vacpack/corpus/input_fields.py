"""Reading JSON records wherever they are read (corpus, prompt and batch files, Ray Data
columns): which lines hold one, a line's object, and which of its fields holds a document's
text."""

from __future__ import annotations

import codecs
import json
from typing import Any

TEXT_KEYS = ("text", "input", "prompt")


def is_blank_line(raw: bytes) -> bool:
    """Whether a line holds only whitespace (after a byte-order mark). Every JSON Lines reader
    here skips such a line, as most JSONL readers do (an editor's trailing empty line is no
    record, and no error either): run-batch, `generate --input`, the corpus commands, and Ray
    Data's reader under --ray."""
    return not without_byte_order_mark(raw).strip()


def without_byte_order_mark(raw: bytes) -> bytes:
    """A line without the UTF-8 byte-order mark that some editors and exports (Windows Notepad,
    Excel's "CSV UTF-8") put at the start of a file. It is no part of the first record: every
    reader drops it (run-batch, `generate --input`, the corpus commands), and a line's digest
    does not count it, so that a file saved again with or without one resumes unchanged."""
    return raw.removeprefix(codecs.BOM_UTF8)


def decode_line(raw: bytes) -> str:
    """A line's text: UTF-8, without a byte-order mark or the line end. UnicodeDecodeError for
    bytes that are not UTF-8."""
    return without_byte_order_mark(raw).decode("utf-8").rstrip("\r\n")


def parse_json_object(line: str) -> dict[str, Any] | str:
    """A JSON line's object, or what is wrong with the line, worded to follow "line N"."""
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, RecursionError) as error:
        return f"is not valid JSON: {error}"
    if not isinstance(record, dict):
        return "is not a JSON object"
    return record
