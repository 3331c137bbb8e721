"""Pythonic call lists (Llama 3.2 and Llama 4 with their pythonic templates, some others): the
whole output is a Python list of calls with keyword arguments,
``[get_weather(city="Paris", days=2), now()]``, optionally between Llama 4's
``<|python_start|>`` and ``<|python_end|>``. Arguments are literals (JSON's true, false and null
are read as Python's True, False and None); the text is parsed, never evaluated."""

from __future__ import annotations

import ast
import json
from collections.abc import Mapping
from typing import Any

from vacpack.openai_api.tool_parsers.base import (
    ParsedOutput,
    ToolCall,
    WholeOutputCallsParser,
    new_tool_call,
)


class PythonicToolParser(WholeOutputCallsParser):
    name = "pythonic"
    TAG = "<|python_start|>"  # Llama 4's wrapping of a call list
    END = "<|python_end|>"
    OPENER = "["

    def parse(self, text: str) -> ParsedOutput:
        body = self._call_text(text)
        calls = _pythonic_calls(body) if body is not None else []
        return ParsedOutput(None, calls) if calls else ParsedOutput(text, [])

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
        if body.startswith(self.TAG):
            body = body[len(self.TAG) :].removesuffix(self.END).strip()
        return body if body.startswith(self.OPENER) and body.endswith("]") else None


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
