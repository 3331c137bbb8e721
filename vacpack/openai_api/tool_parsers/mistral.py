"""Mistral 7B v0.3, Nemo, Small: content, then ``[TOOL_CALLS]`` and a JSON list of
``{"name": ..., "arguments": {...}}``; newer tokenizers write each call as
``[TOOL_CALLS]name[ARGS]{...}``. Call ids are nine letters and digits, the only ids Mistral's
chat templates take back."""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Mapping
from typing import Any

from vacpack.openai_api.tool_parsers.base import (
    MarkedCallsParser,
    ToolCall,
    call_from_json,
    new_tool_call,
)


class MistralToolParser(MarkedCallsParser):
    name = "mistral"
    START = "[TOOL_CALLS]"
    ARGS = "[ARGS]"

    def _calls(self, text: str, start: int) -> list[ToolCall]:
        body = text[start + len(self.START) :]
        return self._named_calls(body) if self.ARGS in body else self._listed_calls(body)

    def _settled_calls(self, text: str) -> list[ToolCall]:
        return []  # the calls are read once the output is finished

    def call_grammar(self, call_schema: Mapping[str, Any], parallel: bool) -> str:
        repeat = ' (", " call)*' if parallel else ""
        return (
            f'start: {self._marker(self.START)} " [" call{repeat} "]"\n'
            f"call: %json {json.dumps(call_schema)}\n"
        )

    def _listed_calls(self, body: str) -> list[ToolCall]:
        """[{"name": ..., "arguments": ...}, ...] (or one such object), and nothing after."""
        body = body.strip()
        try:
            value, end = json.JSONDecoder().raw_decode(body)
        except (json.JSONDecodeError, RecursionError):
            return []
        if end != len(body):
            return []
        values = value if isinstance(value, list) else [value]
        calls = [call_from_json(v) for v in values]
        return [_mistral_id(c) for c in calls if c] if all(calls) else []

    def _named_calls(self, body: str) -> list[ToolCall]:
        """name[ARGS]{...}, each call after its own [TOOL_CALLS] (the first one's is cut)."""
        calls = []
        for part in body.split(self.START):
            name, marker, arguments = part.partition(self.ARGS)
            try:
                value = json.loads(arguments)
            except (json.JSONDecodeError, RecursionError):
                return []
            if not marker or not name.strip() or not isinstance(value, dict):
                return []
            calls.append(_mistral_id(new_tool_call(name.strip(), value)))
        return calls


def _mistral_id(call: ToolCall) -> ToolCall:
    """The call with a nine-character id: Mistral's chat templates refuse any other."""
    return dataclasses.replace(call, id=uuid.uuid4().hex[:9])
