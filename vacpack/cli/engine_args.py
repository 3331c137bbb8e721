"""The engine's command-line flags, generated from EngineConfig's fields.

One flag per field, named as vLLM names it (`max_num_seqs` -> `--max-num-seqs`), its help text
the field's docstring and its default the field's default, so the command line can never fall
behind the configuration. Every command that loads a model (generate, the corpus commands,
serve, run-batch, bench) takes them.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import json
import textwrap
import types
import typing
from functools import cache
from typing import Any

from vacpack.config import EngineConfig, speculation_fields


@cache
def field_docs(config_class: type) -> dict[str, str]:
    """Each dataclass field's docstring (the string literal right after it), by field name."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(config_class)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for statement, following in itertools.pairwise(body):
        if (
            isinstance(statement, ast.AnnAssign)
            and isinstance(statement.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[statement.target.id] = " ".join(following.value.value.split())
    return docs


def add_engine_args(parser: argparse.ArgumentParser, model_required: bool = True) -> None:
    group = parser.add_argument_group("engine")
    docs = field_docs(EngineConfig)
    hints = typing.get_type_hints(EngineConfig)
    for field in dataclasses.fields(EngineConfig):
        flag = "--" + field.name.replace("_", "-")
        help_text = docs.get(field.name, "")
        if field.name == "model":
            group.add_argument(flag, required=model_required, help=help_text)
            continue
        value_type = _without_none(hints[field.name])
        if value_type is bool and field.default is False:
            group.add_argument(flag, action="store_true", help=help_text)
        elif value_type is bool:  # on by default, or decided per device: --flag / --no-flag
            group.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=field.default, help=help_text
            )
        else:
            shown = "" if field.default is None else f" [{field.default}]"
            group.add_argument(flag, type=value_type, default=field.default, help=help_text + shown)
    group.add_argument(
        "--speculative-config",
        type=_json_object,
        default=None,
        help='vLLM\'s form of the speculation flags, as JSON: {"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}',
    )


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig's fields as parsed (all but the model), for `LLM(model, **kwargs)`."""
    kwargs = {
        field.name: getattr(args, field.name)
        for field in dataclasses.fields(EngineConfig)
        if field.name != "model"
    }
    return kwargs | speculation_fields(getattr(args, "speculative_config", None))


def _json_object(text: str) -> dict[str, Any]:
    """A flag's JSON object; argparse reports a ValueError as an invalid value."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {text!r}")
    return value


def _without_none(hint: Any) -> Any:
    """int for `int | None`; other hints as they are."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        members = [member for member in typing.get_args(hint) if member is not type(None)]
        if len(members) == 1:
            return members[0]
    return hint
