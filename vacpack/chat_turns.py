"""Chat messages as chat templates read them, the same from `LLM.chat` and from the server.

OpenAI-style messages are not what templates expect in two ways: content may come as a list of
text parts, and an assistant's earlier tool call carries its arguments as JSON text, which
templates such as Qwen's and Llama 3's write out again with `tojson` (encoding them twice).
Here parts are joined one per line and arguments decoded to an object, as vLLM does; a call
without parameters, written as "", null or no arguments at all, reads as {}.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from vacpack.errors import RequestFieldError


def join_text_parts(texts: Iterable[str]) -> str:
    """Text parts of one message, one per line: parts are often paragraphs or sections."""
    return "\n".join(texts)


def called_function(function: Any, param: str) -> dict[str, Any]:
    """An earlier call's "function" (`param` names it, e.g. messages.1.tool_calls.0.function),
    its arguments decoded; RequestFieldError naming `param` for a malformed one."""
    if function is None:
        return {}
    if not isinstance(function, Mapping):
        raise RequestFieldError(param, f'{param} must be an object with "name" and "arguments"')
    decoded = dict(function)
    arguments = decoded.get("arguments")
    if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
        decoded["arguments"] = {}
    elif isinstance(arguments, str):
        try:
            decoded["arguments"] = json.loads(arguments)
        except json.JSONDecodeError as error:
            message = f"{param}.arguments is not valid JSON: {error}"
            raise RequestFieldError(param, message) from None
        except RecursionError:
            # The decoder's depth limit (about 1,000 levels), far beyond any real call's.
            raise RequestFieldError(
                param, f"{param}.arguments nests JSON arrays or objects too deeply"
            ) from None
        if decoded["arguments"] is None:  # "null"
            decoded["arguments"] = {}
    return decoded


def template_turn(message: Mapping[str, Any], index: int) -> dict[str, Any]:
    """Message `index` of a conversation given as dicts, as templates read it; its other keys
    (name, tool_call_id, or any a template reads) pass through. RequestFieldError for content
    that is not text, or a malformed earlier call."""
    where = f"messages.{index}"
    turn = dict(message)
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part_index, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, Mapping) and part.get("type") == "text":
                texts.append(str(part.get("text", "")))
            else:
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise RequestFieldError(
                    f"{where}.content",
                    f"{where}.content.{part_index} is a {kind!r} part: only text parts are read",
                )
        turn["content"] = join_text_parts(texts)
    tool_calls = message.get("tool_calls")
    if tool_calls:
        calls = []
        for call_index, call in enumerate(tool_calls):
            param = f"{where}.tool_calls.{call_index}.function"
            calls.append({**call, "function": called_function(call.get("function"), param)})
        turn["tool_calls"] = calls
    return turn
