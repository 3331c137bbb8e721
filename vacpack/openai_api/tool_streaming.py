"""Streaming a choice that may call tools: content as it settles, each call once it is complete.

Text that could still turn out to be part of a call (after ``<tool_call>``, or a Llama 3 output
that starts with ``{``) is held back; a call is sent whole, as one OpenAI delta carrying its
id, name and arguments, once its block has closed (or the output has finished). At the end the
same parse as a non-streamed answer runs over the whole text, so the deltas add up to exactly
the content and calls the non-streamed answer has.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vacpack.openai_api.tool_parsers import ToolCall, ToolParser


@dataclass
class ToolCallStream:
    parser: ToolParser
    max_calls: int | None = None  # 1 without parallel_tool_calls: later calls are dropped
    text: str = ""
    num_content_sent: int = 0  # characters of text sent as content
    calls_sent: list[ToolCall] = field(default_factory=list)

    def feed(self, text: str, finished: bool) -> tuple[str, list[ToolCall]]:
        """(new content, newly complete calls) after `text` is appended to the output."""
        self.text += text
        if finished:
            parsed = self.parser.parse(self.text)
            content_end = self.num_content_sent + len(
                (parsed.content or "")[self.num_content_sent :]
            )
            calls = parsed.tool_calls
        else:
            content_end, calls = self.parser.settled(self.text)
        content = self.text[self.num_content_sent : content_end]
        self.num_content_sent = max(self.num_content_sent, content_end)
        new_calls = calls[len(self.calls_sent) : self.max_calls]
        self.calls_sent.extend(new_calls)
        return content, new_calls

    def call_deltas(self, calls: list[ToolCall]) -> list[dict[str, Any]]:
        """OpenAI's tool_calls delta entries for calls just completed."""
        first_index = len(self.calls_sent) - len(calls)
        return [
            {"index": first_index + offset, **call.to_json()} for offset, call in enumerate(calls)
        ]
