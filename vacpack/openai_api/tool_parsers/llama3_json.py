"""Llama 3.1 / 3.2's JSON calls: the whole output is ``{"name": ..., "parameters": {...}}``,
several separated by ``; ``, optionally after ``<|python_tag|>``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from vacpack.openai_api.tool_parsers.base import (
    ParsedOutput,
    WholeOutputCallsParser,
    call_from_json,
)


class Llama3JsonToolParser(WholeOutputCallsParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"
    OPENER = "{"
    SEPARATOR = "; "

    def parse(self, text: str) -> ParsedOutput:
        body = self._call_text(text)
        if body is None:
            return ParsedOutput(text, [])
        calls = []
        decoder = json.JSONDecoder()
        position = 0
        while True:
            try:
                value, end = decoder.raw_decode(body, position)
            except (json.JSONDecodeError, RecursionError):  # text, not a call
                return ParsedOutput(text, [])
            call = call_from_json(value)
            if call is None:
                return ParsedOutput(text, [])
            calls.append(call)
            rest = body[end:].lstrip()
            if not rest:
                return ParsedOutput(None, calls)
            if not rest.startswith(";"):
                return ParsedOutput(text, [])
            position = len(body) - len(rest[1:].lstrip())

    def call_grammar(self, call_schema: Mapping[str, Any], parallel: bool) -> str:
        call_schema = _renamed_arguments(call_schema, "parameters")
        repeat = f" ({json.dumps(self.SEPARATOR)} call)*" if parallel else ""
        return f"start: call{repeat}\ncall: %json {json.dumps(call_schema)}\n"

    def _call_text(self, text: str) -> str | None:
        body = text.strip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG) :].lstrip()
        return body if body.startswith(self.OPENER) else None


def _renamed_arguments(schema: Mapping[str, Any], key: str) -> dict[str, Any]:
    """The call schema with "arguments" named `key` (Llama 3 calls them "parameters")."""
    if "anyOf" in schema:
        return {**schema, "anyOf": [_renamed_arguments(s, key) for s in schema["anyOf"]]}
    properties = dict(schema["properties"])
    properties[key] = properties.pop("arguments")
    return {**schema, "properties": properties, "required": ["name", key]}
