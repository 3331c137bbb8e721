"""A request's output constraints: response_format, structured_outputs, tools and tool_choice,
and the token-level controls (logit_bias, allowed_token_ids, bad_words).

Each is turned into SamplingParams fields here and checked at once (a bad schema gets a 400
naming the field and the problem, before any work), for the server and batch files alike.

Tools: with tool_choice "auto" the model writes freely and its output is parsed for calls in
its format (tool_parsers/); with "required" or a named function the output is constrained
to calls in that format (so they always parse); with "none" nothing is parsed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from vacpack.openai_api.errors import APIError, bad_request
from vacpack.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from vacpack.openai_api.tool_parsers import ToolParser, tool_call_schema
from vacpack.structured.grammars import grammar_spec, with_json_layout
from vacpack.structured.params import StructuredOutputsParams

T = TypeVar("T")


@dataclass(frozen=True)
class ToolPlan:
    """How a chat request's tools are used: passed to the template, parsed from the output."""

    tools: list[dict[str, Any]] | None  # for the chat template
    parser: ToolParser | None  # None: the output is plain content
    parallel: bool


NO_TOOLS = ToolPlan(None, None, True)


def token_controls(request: CompletionRequest | ChatCompletionRequest) -> dict[str, Any]:
    """SamplingParams fields for logit_bias, allowed_token_ids and bad_words (given ones)."""
    controls: dict[str, Any] = {}
    if request.logit_bias:
        bias: dict[int, float] = {}
        for key, value in request.logit_bias.items():
            try:
                token_id = int(key)
            except ValueError:
                raise bad_request(
                    f"logit_bias keys must be token ids, got {key!r}", "logit_bias"
                ) from None
            bias[token_id] = value
        controls["logit_bias"] = bias
    if request.allowed_token_ids is not None:
        controls["allowed_token_ids"] = request.allowed_token_ids
    if request.bad_words is not None:
        controls["bad_words"] = request.bad_words
    return controls


def plan_tools(request: ChatCompletionRequest, parser: ToolParser | None) -> ToolPlan:
    """How the request's tools are used (parser: None when it has none); 400 for a malformed
    tool or tool_choice."""
    tools = request.tools
    choice = request.tool_choice
    if not tools or parser is None:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return NO_TOOLS
    for index, tool in enumerate(tools):
        function = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(function, Mapping):
            raise bad_request(f"tools[{index}] must be a function tool", f"tools[{index}]")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise bad_request(f"tools[{index}].function.name is required", f"tools[{index}]")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, Mapping):
            raise bad_request(
                f"tools[{index}].function.parameters must be a JSON schema object",
                f"tools[{index}]",
            )
    if choice is None:
        choice = "auto"
    if isinstance(choice, str) and choice not in ("none", "auto", "required"):
        raise bad_request(
            f'tool_choice must be "none", "auto", "required" or a named function, got {choice!r}',
            "tool_choice",
        )
    parallel = request.parallel_tool_calls is not False
    return ToolPlan(list(tools), None if choice == "none" else parser, parallel)


# vLLM's guided decoding fields, each the structured_outputs key of the same constraint.
GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def structured_outputs(
    request: CompletionRequest | ChatCompletionRequest, tool_plan: ToolPlan = NO_TOOLS
) -> StructuredOutputsParams | None:
    """The constraint on the output, from structured_outputs, a guided_* field,
    response_format or tool_choice; checked (400 naming the field and the problem)."""
    sources: list[tuple[str, StructuredOutputsParams]] = []
    given = request.structured_outputs
    if given is not None:
        params = _checked("structured_outputs", lambda: StructuredOutputsParams.from_dict(given))
        sources.append(("structured_outputs", params))
    sources.extend(_guided(request))
    from_format = _checked("response_format", lambda: _response_format(request.response_format))
    if from_format is not None:
        sources.append(("response_format", from_format))
    if isinstance(request, ChatCompletionRequest):
        chat = request  # a name of the narrowed type, for the lambda
        from_tools = _checked("tool_choice", lambda: _forced_tool_calls(chat, tool_plan))
        if from_tools is not None:
            sources.append(("tool_choice", from_tools))
    if not sources:
        return None
    if len(sources) > 1:
        names = " and ".join(name for name, _ in sources)
        raise bad_request(f"{names} cannot be combined: give one", sources[1][0])
    field_name, params = sources[0]
    _checked(field_name, lambda: grammar_spec(params))
    return params


def _guided(
    request: CompletionRequest | ChatCompletionRequest,
) -> list[tuple[str, StructuredOutputsParams]]:
    """The constraints the request's guided_* fields give (more than one is refused by the
    caller, as any two sources are)."""
    if request.guided_whitespace_pattern is not None:
        raise bad_request(
            "guided_whitespace_pattern is not supported: JSON output follows the schema with "
            "the grammar's own whitespace",
            "guided_whitespace_pattern",
        )
    sources = []
    for field_name, key in GUIDED_FIELDS.items():
        value = getattr(request, field_name)
        if value is not None:
            params = _checked(
                field_name,
                functools.partial(StructuredOutputsParams, **{key: value}),
                # The constraint's own messages name it as structured_outputs' key.
                named_in_messages=f"structured_outputs.{key}",
            )
            sources.append((field_name, params))
    return sources


def _checked(field_name: str, build: Callable[[], T], named_in_messages: str = "") -> T:
    """build()'s result, with the errors of a malformed constraint as a 400 naming its field
    (also where the messages call it `named_in_messages`).

    ValueError (GrammarError among them) says what is wrong with the value. RecursionError: a
    schema the request's JSON decoder took, but nested deeper than strict mode or writing the
    schema out again can follow from further down the stack."""
    try:
        return build()
    except RecursionError:
        raise bad_request(f"{field_name} nests too deeply", field_name) from None
    except ValueError as error:
        message = str(error)
        if named_in_messages:
            message = message.replace(named_in_messages, field_name)
        raise bad_request(message, field_name) from None


def _response_format(response_format: dict[str, Any] | None) -> StructuredOutputsParams | None:
    if not response_format:
        return None
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise bad_request(
            f'response_format.type must be "text", "json_object" or "json_schema", got {kind!r}',
            "response_format",
        )
    spec = response_format.get("json_schema")
    if not isinstance(spec, Mapping) or not isinstance(spec.get("schema", {}), Mapping):
        raise bad_request(
            'response_format.json_schema must be {"name": ..., "schema": {...}, "strict": ...}',
            "response_format",
        )
    schema = dict(spec.get("schema") or {"type": "object"})
    if spec.get("strict"):
        schema = strict_schema(schema)
    return StructuredOutputsParams(json=schema)


def strict_schema(schema: Any) -> Any:
    """As OpenAI's strict mode: an object schema that does not say otherwise allows no keys
    beyond its properties (JSON Schema's default would allow any), at every level."""
    if not isinstance(schema, Mapping):
        return schema
    strict = dict(schema)
    for key in ("properties", "$defs", "definitions", "patternProperties"):
        if isinstance(strict.get(key), Mapping):
            strict[key] = {name: strict_schema(sub) for name, sub in strict[key].items()}
    for key in ("items", "additionalProperties", "not", "if", "then", "else"):
        if isinstance(strict.get(key), Mapping):
            strict[key] = strict_schema(strict[key])
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        if isinstance(strict.get(key), list):
            strict[key] = [strict_schema(sub) for sub in strict[key]]
    if strict.get("type") == "object" or "properties" in strict:
        strict.setdefault("additionalProperties", False)
    return strict


def _forced_tool_calls(
    request: ChatCompletionRequest, tool_plan: ToolPlan
) -> StructuredOutputsParams | None:
    """A grammar of calls in the parser's format for tool_choice "required" or a named one."""
    choice = request.tool_choice
    if tool_plan.parser is None or tool_plan.tools is None or choice in (None, "auto"):
        return None
    tools = tool_plan.tools
    parallel = tool_plan.parallel
    if isinstance(choice, Mapping):
        function = choice.get("function")
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise bad_request(
                'tool_choice.function must be an object with the function\'s "name"',
                "tool_choice",
            )
        name = function["name"]
        tools = [t for t in tools if t["function"]["name"] == name]
        if choice.get("type", "function") != "function" or not tools:
            raise APIError(
                400,
                f"tool_choice names the function {name!r}, which is not among the tools",
                param="tool_choice",
                code="invalid_value",
            )
        parallel = False
    call_schema = with_json_layout(tool_call_schema(tools))
    return StructuredOutputsParams(grammar=tool_plan.parser.call_grammar(call_schema, parallel))
