"""Chat messages checked as OpenAI checks them: a known role, and the fields that role needs.

OpenAI answers 400 for a role it does not know and for a user, system, developer or tool
message without content; an assistant message may leave content out only when it carries
tool calls (or a legacy function call), and a tool message must name the call it answers.
"""

from __future__ import annotations

from vacpack.openai_api.errors import APIError
from vacpack.openai_api.protocol import ChatMessage

ROLES = ("system", "developer", "user", "assistant", "tool", "function")
_ROLES_NEEDING_CONTENT = frozenset({"system", "developer", "user", "tool", "function"})


def check_messages(messages: list[ChatMessage]) -> None:
    """400 for the first message with an unknown role or without a field its role needs."""
    for index, message in enumerate(messages):
        where = f"messages.{index}"
        if message.role not in ROLES:
            raise _invalid(
                f"{where}.role must be one of {', '.join(ROLES)}; got {message.role!r}",
                f"{where}.role",
            )
        # Declared fields or extras alike (the request models accept unknown fields).
        calls_a_tool = bool(
            getattr(message, "tool_calls", None) or getattr(message, "function_call", None)
        )
        if message.content is None and (message.role in _ROLES_NEEDING_CONTENT or not calls_a_tool):
            param = f"{where}.content"
            unless = " and there are no tool_calls" if message.role == "assistant" else ""
            raise _missing(f"{param} is required when role is {message.role!r}{unless}", param)
        if message.role == "tool" and not isinstance(getattr(message, "tool_call_id", None), str):
            param = f"{where}.tool_call_id"
            raise _missing(f"{param} is required when role is 'tool'", param)


def _invalid(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


def _missing(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="missing_required_parameter")
