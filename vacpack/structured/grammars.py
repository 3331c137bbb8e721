"""What a request asks for -> one llguidance grammar, checked before any work starts.

llguidance (guidance-ai's grammar engine, a Rust library) takes every kind of constraint as one
grammar text: a JSON schema, a regex, a list of choices and a Lark or GBNF grammar all become
it. Checking a grammar needs no tokenizer and takes about a millisecond, so a bad schema is
refused when the request arrives, with llguidance's own description of the problem.

JSON is generated in one fixed layout, ``{"key": value, "other": [1, 2]}``: a space after each
``:`` and ``,`` and nowhere else. A grammar that allows any whitespace lets a model that has lost
its way emit whitespace until ``max_tokens``, leaving a document that does not parse (a failure
vLLM's users report); a fixed layout keeps every token on the document.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import llguidance

from vacpack.structured.params import StructuredOutputsParams

JSON_LAYOUT: Mapping[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


class GrammarError(ValueError):
    """A schema, regex or grammar that cannot constrain generation; the message says why."""


@dataclass(frozen=True)
class GrammarSpec:
    """A checked llguidance grammar. Equal texts compile to the same grammar (the cache key)."""

    text: str
    description: str  # for messages: "a JSON schema", "a regex", ...


def grammar_spec(params: StructuredOutputsParams) -> GrammarSpec:
    """The llguidance grammar for a constraint; GrammarError if it cannot be compiled."""
    kind = params.kind
    if kind == "json":
        text = json_schema_grammar(params.json)  # type: ignore[arg-type]
        description = "the JSON schema"
    elif kind == "json_object":
        text = json_schema_grammar({"type": "object"})
        description = "json_object"
    elif kind == "regex":
        text = llguidance.LLMatcher.grammar_from_regex(params.regex or "")
        description = "the regex"
    elif kind == "choice":
        text = llguidance.grammar_from("choice", json.dumps(list(params.choice or ())))
        description = "the choices"
    else:
        text = _grammar_text(params.grammar or "")
        description = "the grammar"
    check_grammar(text, description)
    return GrammarSpec(text, description)


def json_schema_grammar(schema: Mapping[str, Any]) -> str:
    laid_out = with_json_layout(schema)
    try:
        text = json.dumps(laid_out)
    except RecursionError:
        # The schema came from JSON the decoder took, but writing it out again here, deeper in
        # the stack, can pass the interpreter's recursion limit.
        raise GrammarError("the JSON schema nests too deeply") from None
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(text)
    except ValueError as error:
        raise GrammarError(f"the JSON schema is not usable: {error}") from None


def with_json_layout(schema: Mapping[str, Any]) -> dict[str, Any]:
    """The schema with llguidance's layout options set to JSON_LAYOUT (where the schema does
    not set them itself), for schemas embedded in a Lark grammar as well."""
    options = schema.get("x-guidance", {})
    if not isinstance(options, Mapping):
        raise GrammarError(
            f'the JSON schema\'s "x-guidance" must be an object of llguidance options, got '
            f"{type(options).__name__}"
        )
    return {**schema, "x-guidance": {**JSON_LAYOUT, **options}}


def lark_grammar(lark: str, description: str) -> GrammarSpec:
    """A checked grammar from Lark text (used to build tool-call grammars)."""
    text = llguidance.LLMatcher.grammar_from_lark(lark)
    check_grammar(text, description)
    return GrammarSpec(text, description)


def check_grammar(text: str, description: str) -> None:
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text)
    if is_error:
        problem = messages[0].strip() if messages else "unknown error"
        raise GrammarError(f"{description} cannot constrain generation: {problem}")


def _grammar_text(grammar: str) -> str:
    # "::=" marks GBNF (llama.cpp's EBNF); llguidance converts it to Lark.
    try:
        return llguidance.grammar_from("ebnf" if "::=" in grammar else "lark", grammar)
    except Exception as error:  # the GBNF converter raises its own error types
        raise GrammarError(f"the grammar cannot be parsed: {error}") from None
