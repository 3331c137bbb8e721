"""What every tool-call parser shares: the calls it finds, its interface, and the base of the
formats whose calls follow a marker after the content (Hermes, Mistral)."""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None
    tool_calls: list[ToolCall]


def new_tool_call(name: str, arguments: Any) -> ToolCall:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", name, text)


def call_from_json(value: Any) -> ToolCall | None:
    """A call from {"name": ..., "arguments" or "parameters": {...}}, else None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if not isinstance(arguments, dict):
        return None
    return new_tool_call(value["name"], arguments)


class ToolParser(ABC):
    name: str

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer

    @abstractmethod
    def parse(self, text: str) -> ParsedOutput:
        """A finished output's content and tool calls."""

    @abstractmethod
    def settled(self, text: str) -> tuple[int, list[ToolCall]]:
        """For a growing output: how many leading characters are content for sure, and the
        calls complete so far (the same ones parse() would find in them)."""

    @abstractmethod
    def call_grammar(self, call_schema: Mapping[str, Any], parallel: bool) -> str:
        """A Lark grammar (llguidance syntax) for one call, or several when parallel, whose
        JSON matches call_schema: {"name": ..., "arguments": {...}} per allowed tool."""

    def _marker(self, text: str) -> str:
        """A Lark literal for a marker: its token where the tokenizer has it as a special token
        (which text literals never match), else its text."""
        token_id = self.tokenizer.convert_tokens_to_ids(text)
        special = set(getattr(self.tokenizer, "all_special_ids", ()))
        if isinstance(token_id, int) and token_id in special:
            return f"<[{token_id}]>"
        return json.dumps(text)


class MarkedCallsParser(ToolParser):
    """Content, then calls from the first START marker on (Hermes, Mistral)."""

    START: str

    @abstractmethod
    def _calls(self, text: str, start: int) -> list[ToolCall]:
        """The calls from START on (at `start`): all of them, or none where any is malformed."""

    @abstractmethod
    def _settled_calls(self, text: str) -> list[ToolCall]:
        """The calls of a growing output that are complete already."""

    def parse(self, text: str) -> ParsedOutput:
        start = text.find(self.START)
        calls = self._calls(text, start) if start >= 0 else []
        if not calls:
            return ParsedOutput(text, [])
        return ParsedOutput(text[:start] or None, calls)

    def settled(self, text: str) -> tuple[int, list[ToolCall]]:
        start = text.find(self.START)
        if start < 0:
            return without_partial_marker(text, self.START), []
        return start, self._settled_calls(text)


class WholeOutputCallsParser(ToolParser):
    """Formats whose calls are the whole output, opening with OPENER after an optional TAG
    (Llama 3's JSON, pythonic lists): nothing is content while the output may still become
    calls, and their text is read once it is finished."""

    TAG: str
    OPENER: str

    def settled(self, text: str) -> tuple[int, list[ToolCall]]:
        stripped = text.lstrip()
        may_be_calls = (
            not stripped
            or self.TAG.startswith(stripped[: len(self.TAG)])
            or stripped.startswith(self.OPENER)  # or content that opens the same way
        )
        return (0, []) if may_be_calls else (len(text), [])


def without_partial_marker(text: str, marker: str) -> int:
    """len(text), less a tail that could be the start of `marker`."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return len(text) - length
    return len(text)
