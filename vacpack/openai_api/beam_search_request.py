"""vLLM's `use_beam_search` on completions and chat requests: the request's n is the beam width.

A beam search scores every beam on the model's own log-probabilities, so a request field that
changes how tokens are drawn, stopped or constrained would be silently ignored by it: such a
field is refused with a 400 that names it instead.
"""

from __future__ import annotations

from typing import Any

from vacpack.beam_search import BeamSearchParams
from vacpack.openai_api.errors import APIError, bad_request
from vacpack.openai_api.protocol import ChatCompletionRequest, CompletionRequest

# Request fields a beam search cannot honour, refused when given with a value that asks for
# something (False, and an empty list, ask for nothing).
_NOT_WITH_BEAM_SEARCH = (
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "stop_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "structured_outputs",
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "logprobs",
    "top_logprobs",
    "echo",
    "tools",
)


def beam_search_params(
    request: CompletionRequest | ChatCompletionRequest,
    max_tokens: int | None,
    longest_prompt: int,
    max_model_len: int,
) -> BeamSearchParams | None:
    """The request's beam search, or None when it does not ask for one. Without max_tokens a
    search may run to the end of the context."""
    if not request.use_beam_search:
        if request.length_penalty is not None:
            raise bad_request("length_penalty applies to use_beam_search only", "length_penalty")
        return None
    for name in _NOT_WITH_BEAM_SEARCH:
        if _asks_for_something(getattr(request, name, None)):
            raise bad_request(f"{name} does not apply with use_beam_search", name)
    if request.temperature not in (None, 0, 0.0):
        raise bad_request(
            "temperature must be 0 (or left out) with use_beam_search: beams are scored on the "
            "model's own log-probabilities",
            "temperature",
        )
    if max_tokens is None:
        max_tokens = max_model_len - longest_prompt
    try:
        return BeamSearchParams(
            beam_width=request.n or 1,
            max_tokens=max_tokens,
            ignore_eos=bool(request.ignore_eos),
            length_penalty=1.0 if request.length_penalty is None else request.length_penalty,
            include_stop_str_in_output=bool(request.include_stop_str_in_output),
        )
    except ValueError as error:
        field, _, rest = str(error).partition(" ")
        param = {"beam_width": "n"}.get(field, field)
        raise APIError(400, f"{param} {rest}", param=param, code="invalid_value") from None


def _asks_for_something(value: Any) -> bool:
    return value is not None and value is not False and value != [] and value != {}
