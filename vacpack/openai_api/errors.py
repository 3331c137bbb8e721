"""Errors a client caused (or the server hit), carried to the client in OpenAI's error shape."""

from __future__ import annotations

from typing import Any

from vacpack.errors import RequestFieldError

# Status -> OpenAI's error "type" for it.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """A request that cannot be answered normally: its HTTP status and a message for the client.

    `param` names the request field at fault (None when no single field is), `code` is a short
    machine-readable reason, and `headers` are extra response headers (such as Retry-After).
    """

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def to_body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": _ERROR_TYPES.get(self.status_code, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param, code="invalid_value" if param else None)


def internal_error(error: BaseException) -> APIError:
    """The 500 for an exception no check expected (a bug), naming it."""
    return APIError(500, f"internal error: {type(error).__name__}: {error}")


def refused_by_engine(error: ValueError, where: str = "") -> APIError:
    """The 400 for a request the engine refused when it was added (`where` leads the message,
    e.g. which of a request's prompts): its field where the error names one, else the prompt."""
    param = error.field if isinstance(error, RequestFieldError) else "prompt"
    return bad_request(f"{where}{error}", param)
