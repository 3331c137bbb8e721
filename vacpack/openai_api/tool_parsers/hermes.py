"""Hermes 2 Pro / Qwen 2.5 / Qwen 3: ``<tool_call>\n{"name": ..., "arguments": {...}}
\n</tool_call>``, one block per call; content is the text before the first block."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from vacpack.openai_api.tool_parsers.base import MarkedCallsParser, ToolCall, call_from_json


class HermesToolParser(MarkedCallsParser):
    name = "hermes"
    START = "<tool_call>"
    END = "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def _calls(self, text: str, start: int) -> list[ToolCall]:
        return [c for c in (self._call(m.group(1)) for m in self._BLOCK.finditer(text)) if c]

    def _settled_calls(self, text: str) -> list[ToolCall]:
        closed = text[: text.rfind(self.END) + len(self.END)] if self.END in text else ""
        return self._calls(closed, 0)

    def call_grammar(self, call_schema: Mapping[str, Any], parallel: bool) -> str:
        call = f'{self._marker(self.START)} "\\n" %json {json.dumps(call_schema)} "\\n" ' + (
            self._marker(self.END)
        )
        repeat = ' ("\\n" call)*' if parallel else ""
        return f"start: call{repeat}\ncall: {call}\n"

    @staticmethod
    def _call(block: str) -> ToolCall | None:
        try:
            return call_from_json(json.loads(block))
        except (json.JSONDecodeError, RecursionError):  # not JSON, or nested past the stack
            return None
