"""Engine logprobs -> OpenAI's two logprobs formats (legacy completions, and chat).

An engine position is a dict token id -> Logprob holding the chosen token and the top-k
candidates. JSON has no -inf, so an impossible token's logprob is sent as -9999.0 (as vLLM does).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from vacpack.openai_api.token_bytes import token_bytes_reader
from vacpack.outputs import Logprob, PositionLogprobs
from vacpack.tokenizer import decode_text

_JSON_SAFE_MIN_LOGPROB = -9999.0


class DecodeToken:
    """What a token id reads as, for positions whose Logprob carries no decoded text: its own
    text, decoded alone; and its own bytes (token_bytes.py)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self.token_bytes = token_bytes_reader(tokenizer)

    def __call__(self, token_id: int) -> str:
        return decode_text(self._tokenizer, [token_id])


def json_safe(logprob: float) -> float:
    if math.isnan(logprob) or logprob < _JSON_SAFE_MIN_LOGPROB:
        return _JSON_SAFE_MIN_LOGPROB
    return logprob


def _token_text(token_id: int, logprob: Logprob | None, decode_token: DecodeToken) -> str:
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    return decode_token(token_id)


@dataclass
class CompletionLogprobs:
    """The legacy completions `logprobs` object, built up position by position.

    `text_offset` counts characters from the start of the choice's text (the prompt's start
    when echoing), continuing across streamed chunks.
    """

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]

    @classmethod
    def empty(cls) -> CompletionLogprobs:
        return cls([], [], [], [])

    def add_positions(
        self,
        token_ids: Sequence[int],
        positions: Sequence[PositionLogprobs | None],
        decode_token: DecodeToken,
        start_offset: int,
    ) -> int:
        """Appends one entry per token; returns the text offset after the last one."""
        offset = start_offset
        for token_id, position in zip(token_ids, positions, strict=True):
            chosen = position.get(token_id) if position is not None else None
            text = _token_text(token_id, chosen, decode_token)
            self.tokens.append(text)
            self.text_offset.append(offset)
            offset += len(text)
            if position is None:  # the first prompt token: nothing before it to score it
                self.token_logprobs.append(None)
                self.top_logprobs.append(None)
                continue
            self.token_logprobs.append(json_safe(chosen.logprob) if chosen else None)
            self.top_logprobs.append(
                {
                    _token_text(tid, lp, decode_token): json_safe(lp.logprob)
                    for tid, lp in sorted(position.items(), key=lambda item: _rank(item[1]))
                }
            )
        return offset

    def to_json(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }


def chat_logprobs_content(
    token_ids: Sequence[int],
    positions: Sequence[PositionLogprobs],
    num_top_logprobs: int,
    decode_token: DecodeToken,
) -> list[dict[str, Any]]:
    """Chat's `logprobs.content`: per token, its logprob and exactly the top-k candidates."""
    content = []
    for token_id, position in zip(token_ids, positions, strict=True):
        chosen = position.get(token_id)
        top = sorted(
            (item for item in position.items() if _rank(item[1]) <= num_top_logprobs),
            key=lambda item: _rank(item[1]),
        )
        content.append(
            {
                **_chat_entry(token_id, chosen, decode_token),
                "top_logprobs": [_chat_entry(tid, lp, decode_token) for tid, lp in top],
            }
        )
    return content


def _chat_entry(token_id: int, logprob: Logprob | None, decode_token: DecodeToken) -> dict:
    text = _token_text(token_id, logprob, decode_token)
    return {
        "token": text,
        "logprob": json_safe(logprob.logprob) if logprob else _JSON_SAFE_MIN_LOGPROB,
        "bytes": list(decode_token.token_bytes(token_id, text)),
    }


def _rank(logprob: Logprob) -> int:
    return logprob.rank if logprob.rank is not None else math.inf  # type: ignore[return-value]
