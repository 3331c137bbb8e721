"""What a request asks for -> one llguidance grammar, checked before any work starts.

llguidance (guidance-ai's grammar engine, a Rust library) takes every kind of constraint as one
grammar text: a JSON schema, a regex, a list of choices and a Lark or GBNF grammar all become
it. Checking a grammar needs no tokenizer and takes about a millisecond, so a bad schema is
refused when the request arrives, with llguidance's own description of the problem. A grammar
or regex that llguidance accepts but that matches only the empty string (`root ::= `) is refused
too: a matcher over a one-token-per-byte vocabulary (about 2 ms) shows it allows no first byte.

JSON is generated in one fixed layout, ``{"key": value, "other": [1, 2]}``: a space after each
``:`` and ``,`` and nowhere else. A grammar that allows any whitespace lets a model that has lost
its way emit whitespace until ``max_tokens``, leaving a document that does not parse (a failure
vLLM's users report); a fixed layout keeps every token on the document.
"""

from __future__ import annotations

import functools
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

# The byte vocabulary's tokens 0-255 are the byte values; token 256 ends the output.
_NUM_BYTES = 256


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
    # A JSON value or a choice is never empty; a grammar or a regex can match "" alone.
    if kind in ("grammar", "regex") and matches_only_empty_text(text):
        what = "the regex" if kind == "regex" else "the grammar's root rule"
        example = "" if kind == "regex" else ' (it is empty, as in `root ::= ` or `root ::= ""`)'
        raise GrammarError(
            f"{what} matches only the empty string{example}: the output could only be empty; "
            "give it something to match"
        )
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


def matches_only_empty_text(text: str) -> bool:
    """Whether a checked grammar matches the empty string and nothing else: at its start it
    allows no byte at all, only the end. llguidance accepts such a grammar, and a request
    under it would end at its first token with empty text, min_tokens and ignore_eos aside.

    False where the grammar names special tokens, which the byte vocabulary here lacks."""
    matcher = llguidance.LLMatcher(_byte_tokenizer(), text, log_level=0)
    if matcher.is_error():
        return False
    mask = matcher.compute_bitmask()
    return not any(mask[byte // 8] >> (byte % 8) & 1 for byte in range(_NUM_BYTES))


class _ByteVocabulary:
    """One token per byte value, then an end token: under it a grammar's first token mask says
    which bytes its output can start with. What llguidance's TokenizerWrapper reads."""

    eos_token_id = _NUM_BYTES
    bos_token_id = None
    tokens = (*(bytes([value]) for value in range(_NUM_BYTES)), b"\xff[END]")
    special_token_ids = (eos_token_id,)

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode("utf-8"))


@functools.cache
def _byte_tokenizer() -> llguidance.LLTokenizer:
    # Built once (a few ms), shared by every thread: an LLTokenizer is immutable.
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocabulary()))


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
