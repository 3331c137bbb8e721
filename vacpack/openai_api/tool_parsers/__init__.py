"""Tool calls in a model's text: the Hermes / Qwen ``<tool_call>`` format, Llama 3's JSON,
Mistral's ``[TOOL_CALLS]`` and the pythonic call lists of Llama 3.2 / 4.

Each parser splits a finished output into content and tool calls, builds the grammar that
forces a call in its format (tool_choice "required" or a named function), and says how much of
a growing output is settled, so that streaming (vacpack/openai_api/tool_streaming.py) sends the
same content and calls a non-streamed answer would have.

One module per format: ``hermes`` (Hermes 2 Pro, Qwen 2.5 / 3: ``<tool_call>`` blocks),
``llama3_json`` (Llama 3.1 / 3.2's JSON), ``mistral`` (``[TOOL_CALLS]``, both of its forms),
``pythonic`` (Llama 3.2 / 4's Python call lists); what they share is in ``base``.

The parser is picked from the chat template (it names ``<tool_call>``, ``<|python_tag|>``,
``[TOOL_CALLS]`` or ``<|python_start|>``) or by ``--tool-call-parser``, as vLLM does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from vacpack.openai_api.tool_parsers.base import ParsedOutput, ToolCall, ToolParser
from vacpack.openai_api.tool_parsers.hermes import HermesToolParser
from vacpack.openai_api.tool_parsers.llama3_json import Llama3JsonToolParser
from vacpack.openai_api.tool_parsers.mistral import MistralToolParser
from vacpack.openai_api.tool_parsers.pythonic import PythonicToolParser

TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral", "pythonic")

__all__ = [
    "TOOL_CALL_PARSERS",
    "ParsedOutput",
    "ToolCall",
    "ToolParser",
    "tool_call_schema",
    "tool_parser",
]


_PARSERS: dict[str, type[ToolParser]] = {
    HermesToolParser.name: HermesToolParser,
    Llama3JsonToolParser.name: Llama3JsonToolParser,
    MistralToolParser.name: MistralToolParser,
    PythonicToolParser.name: PythonicToolParser,
}


def tool_parser(name: str, tokenizer: PreTrainedTokenizerBase) -> ToolParser:
    """The named parser, or with "auto" the one the chat template's format says (Hermes when
    the template names no other's marker)."""
    if name == "auto":
        template = str(getattr(tokenizer, "chat_template", "") or "")
        name = HermesToolParser.name
        if "<tool_call>" not in template:
            if "<|python_tag|>" in template:
                name = Llama3JsonToolParser.name
            elif MistralToolParser.START in template:
                name = MistralToolParser.name
            elif PythonicToolParser.TAG in template:
                name = PythonicToolParser.name
    if name not in _PARSERS:
        raise ValueError(
            f"unknown tool call parser {name!r}; known: {', '.join(TOOL_CALL_PARSERS)}"
        )
    return _PARSERS[name](tokenizer)


def tool_call_schema(tools: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The JSON schema of one call to any of `tools` (OpenAI function tools)."""
    variants = [
        {
            "type": "object",
            "properties": {
                "name": {"const": tool["function"]["name"]},
                "arguments": tool["function"].get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    return variants[0] if len(variants) == 1 else {"anyOf": variants}
