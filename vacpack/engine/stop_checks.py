"""Whether a sequence stops at the token it just sampled, and why (vLLM's rules)."""

from __future__ import annotations

from vacpack.engine.request import Sequence

# (finish_reason, stop_reason): "stop" with the stop token id, the stop string or None (EOS), or
# "length" with None.
Stop = tuple[str, int | str | None]


def check_stop(sequence: Sequence, token_id: int, output_complete: bool = False) -> Stop | None:
    """Feeds the token to the sequence's detokenizer and says whether the sequence ends here.
    output_complete: the sequence's grammar allows no more tokens (structured outputs)."""
    params = sequence.params
    # The sampler suppressed stop tokens until min_tokens, so any stop token here counts.
    stops_on_token = token_id in sequence.stop_token_ids
    if stops_on_token and not params.include_stop_str_in_output:
        stop_string = None  # as in vLLM, the stop token's own text is left out
    else:
        stop_string = sequence.detokenizer.update(
            [token_id], check_stop_strings=sequence.num_output_tokens > params.min_tokens
        )
    if stop_string is not None:
        # Also when a stop token's own text (kept by include_stop_str_in_output) completed the
        # stop string: vLLM names the string then, as the text is cut at it.
        return "stop", stop_string
    if stops_on_token:
        # EOS ends the sequence with stop_reason None, as in vLLM; a stop_token_id names itself.
        return "stop", token_id if token_id in (params.stop_token_ids or ()) else None
    if output_complete:
        return "stop", None
    max_output_tokens = params.max_tokens or sequence.max_total_tokens
    if (
        sequence.num_output_tokens >= max_output_tokens
        or sequence.num_known_tokens >= sequence.max_total_tokens
    ):
        return "length", None
    return None
