"""Checks that depend on how a run was started, not on the request alone: the model name a
request may give, and the most choices (n) one request may ask for.

The server and batch files share them, so both refuse the same requests with the same status
and message. This module imports nothing heavy: option parsing reads DEFAULT_MAX_N from it.
"""

from __future__ import annotations

from vacpack.openai_api.errors import APIError, bad_request

# OpenAI's own bound on n. vLLM's bound (VLLM_MAX_N_SEQUENCES, 16,384) only guards memory; here
# a request's n sequences run together, so a much larger n would hold most of the engine's
# slots for one client (and every sequence costs memory while it is added).
DEFAULT_MAX_N = 128


def check_model(model: str | None, served_model_name: str) -> None:
    """404 model_not_found unless the request names the served model (or none: the default)."""
    if model is not None and model != served_model_name:
        raise APIError(
            404,
            f"The model `{model}` does not exist; the model served here is `{served_model_name}`.",
            param="model",
            code="model_not_found",
        )


def check_n(n: int | None, max_n: int) -> None:
    """400 when a request asks for more choices than the run allows (--max-n)."""
    if n is not None and n > max_n:
        raise bad_request(f"n must be at most {max_n} here (--max-n), got {n}", "n")
