"""StructuredOutputsParams: what a generated output must look like, with vLLM's names.

Exactly one of ``json``, ``json_object``, ``regex``, ``choice`` and ``grammar`` is given. The
checks here are about shapes and types only; whether a schema, regex or grammar can be
compiled is checked by vacpack.structured.grammars, which names the problem it finds.
"""

from __future__ import annotations

import json as json_module
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

CONSTRAINT_FIELDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on a request's output.

    - ``json``: a JSON schema (a dict, or its JSON text); the output is a JSON value that
      validates against it.
    - ``json_object=True``: the output is any JSON object.
    - ``regex``: the output matches the regular expression (Rust ``regex`` syntax, anchored at
      both ends).
    - ``choice``: the output is exactly one of these strings.
    - ``grammar``: a context-free grammar, in Lark syntax or in llama.cpp's GBNF (EBNF with
      ``::=``; its start rule is ``root``).
    """

    json: str | Mapping[str, Any] | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [name for name in CONSTRAINT_FIELDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, json_object, regex, choice, "
                f"grammar; got {given or 'none'}"
            )
        if self.json is not None:
            object.__setattr__(self, "json", _as_schema(self.json))
        if self.json_object not in (None, True, False):
            raise ValueError(
                f"structured_outputs.json_object must be a bool, got {self.json_object!r}"
            )
        for field_name in ("regex", "grammar"):
            value = getattr(self, field_name)
            if value is not None and not (isinstance(value, str) and value):
                raise ValueError(f"structured_outputs.{field_name} must be a non-empty string")
        if self.choice is not None:
            choices = self.choice
            # A sequence, not just any iterable: a JSON object would iterate as its keys, and a
            # number (from a request's JSON) not at all.
            is_list = isinstance(choices, Sequence) and not isinstance(choices, str)
            if not is_list or not all(isinstance(c, str) for c in choices):
                raise ValueError("structured_outputs.choice must be a list of strings")
            if not choices or any(c == "" for c in choices):
                raise ValueError(
                    "structured_outputs.choice must be non-empty strings, at least one"
                )
            object.__setattr__(self, "choice", tuple(choices))

    @property
    def kind(self) -> str:
        """Which constraint this is: one of CONSTRAINT_FIELDS."""
        return next(name for name in CONSTRAINT_FIELDS if getattr(self, name) not in (None, False))

    @classmethod
    def from_dict(
        cls, value: Any, field_name: str = "structured_outputs"
    ) -> StructuredOutputsParams:
        """From a JSON object as a request or a JSONL line carries it; ValueError if malformed."""
        if isinstance(value, StructuredOutputsParams):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"{field_name} must be an object, got {type(value).__name__}")
        known = {*CONSTRAINT_FIELDS}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"{field_name} has unknown keys {unknown}; known: {sorted(known)}")
        return cls(**dict(value))


def _as_schema(schema: str | Mapping[str, Any]) -> dict[str, Any]:
    """The schema as a dict (from its JSON text when given as a string)."""
    if isinstance(schema, str):
        try:
            schema = json_module.loads(schema)
        except json_module.JSONDecodeError as error:
            raise ValueError(f"structured_outputs.json is not valid JSON: {error}") from None
        except RecursionError:
            # The decoder's depth limit (about 1,000 levels), far beyond any real schema's.
            raise ValueError(
                "structured_outputs.json nests JSON arrays or objects too deeply"
            ) from None
    if not isinstance(schema, Mapping):
        raise ValueError(
            "structured_outputs.json must be a JSON schema: an object or its JSON text, "
            f"got {type(schema).__name__}"
        )
    return dict(schema)
