"""Tool calls in a model's text: the Hermes / Qwen ``<tool_call>`` format, Llama 3's JSON,
Mistral's ``[TOOL_CALLS]`` and the pythonic call lists of Llama 3.2 / 4.

Each parser splits a finished output into content and tool calls, builds the grammar that
forces a call in its format (tool_choice "required" or a named function), and says how much of
a growing output is settled, so that streaming (vacpack/openai_api/tool_streaming.py) sends the
same content and calls a non-streamed answer would have.

- ``hermes`` (Hermes 2 Pro, Qwen 2.5 / 3): ``<tool_call>\\n{"name": ..., "arguments": {...}}
  \\n</tool_call>``, one block per call; content is the text before the first block.
- ``llama3_json`` (Llama 3.1 / 3.2): the whole output is ``{"name": ..., "parameters": {...}}``,
  several separated by ``; ``, optionally after ``<|python_tag|>``.
- ``mistral`` (Mistral 7B v0.3, Nemo, Small): content, then ``[TOOL_CALLS]`` and a JSON list of
  ``{"name": ..., "arguments": {...}}``; newer tokenizers write each call as
  ``[TOOL_CALLS]name[ARGS]{...}``. Call ids are nine letters and digits, the only ids
  Mistral's chat templates take back.
- ``pythonic`` (Llama 3.2 and Llama 4 with their pythonic templates, some others): the whole
  output is a Python list of calls with keyword arguments,
  ``[get_weather(city="Paris", days=2), now()]``, optionally between Llama 4's
  ``<|python_start|>`` and ``<|python_end|>``. Arguments are literals (JSON's true, false and
  null are read as Python's True, False and None); the text is parsed, never evaluated.

The parser is picked from the chat template (it names ``<tool_call>``, ``<|python_tag|>``,
``[TOOL_CALLS]`` or ``<|python_start|>``) or by ``--tool-call-parser``, as vLLM does.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral", "pythonic")


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


class _MarkedCallsParser(ToolParser):
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
            return _without_partial_marker(text, self.START), []
        return start, self._settled_calls(text)


class HermesToolParser(_MarkedCallsParser):
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


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"
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

    def settled(self, text: str) -> tuple[int, list[ToolCall]]:
        stripped = text.lstrip()
        if not stripped or self.PYTHON_TAG.startswith(stripped[: len(self.PYTHON_TAG)]):
            return 0, []  # may still become a call
        if stripped.startswith("{"):
            return 0, []  # a call: its JSON is parsed once the output is finished
        return len(text), []

    def call_grammar(self, call_schema: Mapping[str, Any], parallel: bool) -> str:
        call_schema = _renamed_arguments(call_schema, "parameters")
        repeat = f" ({json.dumps(self.SEPARATOR)} call)*" if parallel else ""
        return f"start: call{repeat}\ncall: %json {json.dumps(call_schema)}\n"

    def _call_text(self, text: str) -> str | None:
        body = text.strip()
        if body.startswith(self.PYTHON_TAG):
            body = body[len(self.PYTHON_TAG) :].lstrip()
        return body if body.startswith("{") else None


class MistralToolParser(_MarkedCallsParser):
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


class PythonicToolParser(ToolParser):
    name = "pythonic"
    START = "<|python_start|>"  # Llama 4's wrapping of a call list
    END = "<|python_end|>"

    def parse(self, text: str) -> ParsedOutput:
        body = self._call_text(text)
        calls = _pythonic_calls(body) if body is not None else []
        return ParsedOutput(None, calls) if calls else ParsedOutput(text, [])

    def settled(self, text: str) -> tuple[int, list[ToolCall]]:
        stripped = text.lstrip()
        if not stripped or self.START.startswith(stripped[: len(self.START)]):
            return 0, []  # may still become a call list
        if stripped.startswith("["):
            return 0, []  # a call list (or content that opens with "["): read once finished
        return len(text), []

    def call_grammar(self, call_schema: Mapping[str, Any], parallel: bool) -> str:
        layout = call_schema.get("x-guidance")
        variants = call_schema.get("anyOf", [call_schema])
        rules = [f"call_{i}: {_pythonic_call_rule(v, layout)}" for i, v in enumerate(variants)]
        calls = " | ".join(f"call_{i}" for i in range(len(variants)))
        repeat = ' (", " call)*' if parallel else ""
        return "\n".join(
            [f'start: "[" call{repeat} "]"', f"call: {calls}", *rules, KEYWORD_TERMINAL, ""]
        )

    def _call_text(self, text: str) -> str | None:
        body = text.strip()
        if body.startswith(self.START):
            body = body[len(self.START) :].removesuffix(self.END).strip()
        return body if body.startswith("[") and body.endswith("]") else None


# An argument name of a tool whose parameters list none.
KEYWORD_TERMINAL = "KEYWORD: /[A-Za-z_][A-Za-z0-9_]*/"
# JSON's constants, which a model writing Python literals may still use.
_JSON_CONSTANTS = {"true": True, "false": False, "null": None}


def _pythonic_calls(body: str) -> list[ToolCall]:
    """The calls of ``[name(keyword=literal, ...), ...]``: all of them, or none where anything
    is not such a call (a positional argument, an expression, a value JSON cannot carry)."""
    try:
        tree = ast.parse(body, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return []
    calls = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return []
        try:
            arguments = {k.arg: _literal(k.value) for k in node.keywords if k.arg is not None}
            text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
        except (ValueError, TypeError, RecursionError):  # not a literal, or not JSON's
            return []
        if len(arguments) != len(node.keywords):  # a **mapping argument
            return []
        calls.append(new_tool_call(node.func.id, text))
    return calls


class _JsonConstants(ast.NodeTransformer):
    """Turns the names true, false and null into the constants JSON means by them."""

    def visit_Name(self, name: ast.Name) -> ast.AST:
        if name.id in _JSON_CONSTANTS:
            return ast.copy_location(ast.Constant(_JSON_CONSTANTS[name.id]), name)
        return name


def _literal(node: ast.expr) -> Any:
    """A Python literal's value, with JSON's true, false and null read as constants."""
    return ast.literal_eval(_JsonConstants().visit(node))


def _pythonic_call_rule(variant: Mapping[str, Any], layout: Any) -> str:
    """A Lark rule for ``name(keyword=value, ...)``: the tool's parameters as keywords in
    their schema's order, each value JSON (a Python literal too, save true/false/null, which
    the parser reads) matching its schema, the required ones always there."""
    name = variant["properties"]["name"]["const"]
    parameters = variant["properties"]["arguments"]
    properties = parameters.get("properties") if isinstance(parameters, Mapping) else None

    def value(schema: Any) -> str:
        with_layout = {**schema, "x-guidance": layout} if layout else schema
        return f"%json {json.dumps(with_layout)}"

    if not properties:
        any_argument = f'KEYWORD "=" {value({})}'
        arguments = f'({any_argument} (", " {any_argument})*)?'
    else:
        required = set(parameters.get("required", ()))
        items = [
            (f"{json.dumps(key + '=')} {value(schema)}", key in required)
            for key, schema in properties.items()
        ]
        arguments = _keyword_sequence(items)
    return f'{json.dumps(name + "(")} {arguments} ")"'


def _keyword_sequence(items: list[tuple[str, bool]]) -> str:
    """Lark for keyword arguments in order, separated by ", ": each (rule, required) item
    present when required, optional otherwise."""

    def after_first(start: int) -> str:  # the items from `start` on, once one was written
        return " ".join(
            f'", " {rule}' if needed else f'(", " {rule})?' for rule, needed in items[start:]
        )

    def from_(start: int) -> str:  # the items from `start` on, none written yet
        if start == len(items):
            return ""
        rule, needed = items[start]
        this = f"{rule} {after_first(start + 1)}".strip()
        if needed:
            return this
        rest = from_(start + 1)
        return f"({this} | {rest})" if rest else f"({this})?"

    return from_(0)


def _mistral_id(call: ToolCall) -> ToolCall:
    """The call with a nine-character id: Mistral's chat templates refuse any other."""
    return dataclasses.replace(call, id=uuid.uuid4().hex[:9])


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
            elif PythonicToolParser.START in template:
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


def _renamed_arguments(schema: Mapping[str, Any], key: str) -> dict[str, Any]:
    """The call schema with "arguments" named `key` (Llama 3 calls them "parameters")."""
    if "anyOf" in schema:
        return {**schema, "anyOf": [_renamed_arguments(s, key) for s in schema["anyOf"]]}
    properties = dict(schema["properties"])
    properties[key] = properties.pop("arguments")
    return {**schema, "properties": properties, "required": ["name", key]}


def _without_partial_marker(text: str, marker: str) -> int:
    """len(text), less a tail that could be the start of `marker`."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return len(text) - length
    return len(text)
