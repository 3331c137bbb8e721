"""Engine outputs -> OpenAI response bodies (completions, chat completions, embeddings).

A PromptResult gathers one prompt's n choices, from streamed deltas (the server) or from one
final output (batch files); the same body builders then serve both, so a streamed answer and a
non-streamed one cannot drift apart.
"""

from __future__ import annotations

import base64
import struct
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vacpack.openai_api.logprobs import CompletionLogprobs, DecodeToken, chat_logprobs_content
from vacpack.openai_api.requests import EnginePrompt, PreparedGeneration
from vacpack.outputs import (
    CompletionOutput,
    EmbeddingRequestOutput,
    PositionLogprobs,
    RequestOutput,
)


def new_response_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


@dataclass
class ChoiceResult:
    """One choice so far. Text is kept as pieces and joined once, so long outputs stay linear."""

    index: int
    text_pieces: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def text(self) -> str:
        return "".join(self.text_pieces)

    def add_delta(self, delta: CompletionOutput) -> None:
        self.text_pieces.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs or ())
        self.finish_reason = delta.finish_reason
        self.stop_reason = delta.stop_reason


@dataclass
class PromptResult:
    """One prompt's outcome: its n choices and, when asked for, its prompt logprobs."""

    prompt: EnginePrompt
    choices: list[ChoiceResult]
    prompt_logprobs: list[PositionLogprobs | None] | None = None

    @classmethod
    def start(cls, prompt: EnginePrompt, num_choices: int) -> PromptResult:
        return cls(prompt, [ChoiceResult(index) for index in range(num_choices)])

    @classmethod
    def from_final_output(cls, prompt: EnginePrompt, output: RequestOutput) -> PromptResult:
        """From a cumulative (or final-only) output, which carries everything at once."""
        result = cls.start(prompt, len(output.outputs))
        result.add_delta(output)
        return result

    def add_delta(self, output: RequestOutput) -> list[CompletionOutput]:
        """Adds a delta output; returns its completions, for a caller that streams them."""
        if output.prompt_logprobs is not None:
            # Outputs during a chunked prefill carry the prompt logprobs so far; keep the latest.
            self.prompt_logprobs = output.prompt_logprobs
        for delta in output.outputs:
            self.choices[delta.index].add_delta(delta)
        return output.outputs

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(choice.token_ids) for choice in self.choices)


def usage_body(results: Sequence[PromptResult]) -> dict[str, int]:
    # As OpenAI counts: each prompt once, however many choices it has.
    prompt_tokens = sum(r.num_prompt_tokens for r in results)
    completion_tokens = sum(r.num_completion_tokens for r in results)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_logprobs(
    result: PromptResult,
    choice: ChoiceResult,
    echo: bool,
    decode_token: DecodeToken,
) -> dict[str, Any]:
    logprobs = CompletionLogprobs.empty()
    offset = 0
    if echo:
        positions = result.prompt_logprobs or [None] * result.num_prompt_tokens
        offset = logprobs.add_positions(result.prompt.token_ids, positions, decode_token, 0)
    logprobs.add_positions(choice.token_ids, choice.logprobs, decode_token, offset)
    return logprobs.to_json()


def completion_body(
    response_id: str,
    created: int,
    model_name: str,
    prepared: PreparedGeneration,
    results: Sequence[PromptResult],
    decode_token: DecodeToken,
) -> dict[str, Any]:
    choices = []
    for prompt_index, result in enumerate(results):
        for choice in result.choices:
            text = choice.text
            if prepared.echo:
                text = (result.prompt.text or "") + text
            choices.append(
                {
                    "index": prompt_index * prepared.num_choices_per_prompt + choice.index,
                    "text": text,
                    "logprobs": (
                        completion_logprobs(result, choice, prepared.echo, decode_token)
                        if prepared.want_logprobs
                        else None
                    ),
                    "finish_reason": choice.finish_reason,
                    "stop_reason": choice.stop_reason,
                }
            )
    return {
        "id": response_id,
        "object": "text_completion",
        "created": created,
        "model": model_name,
        "choices": choices,
        "usage": usage_body(results),
    }


def chat_message(
    prepared: PreparedGeneration, choice: ChoiceResult
) -> tuple[dict[str, Any], str | None]:
    """A choice's assistant message (content, tool calls) and its finish reason."""
    if prepared.tool_parser is None:
        return {"role": "assistant", "content": choice.text}, choice.finish_reason
    parsed = prepared.tool_parser.parse(choice.text)
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    calls = parsed.tool_calls if prepared.parallel_tool_calls else parsed.tool_calls[:1]
    if not calls:
        return message, choice.finish_reason
    message["tool_calls"] = [call.to_json() for call in calls]
    return message, tool_calls_finish_reason(choice.finish_reason)


def tool_calls_finish_reason(finish_reason: str | None) -> str | None:
    """A choice that called tools finishes with "tool_calls", as OpenAI's do, unless it was
    cut off by its length."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


def chat_body(
    response_id: str,
    created: int,
    model_name: str,
    prepared: PreparedGeneration,
    result: PromptResult,
    decode_token: DecodeToken,
) -> dict[str, Any]:
    num_top = prepared.params.logprobs or 0
    messages = [chat_message(prepared, choice) for choice in result.choices]
    choices = [
        {
            "index": choice.index,
            "message": message,
            "logprobs": (
                {
                    "content": chat_logprobs_content(
                        choice.token_ids, choice.logprobs, num_top, decode_token
                    )
                }
                if prepared.want_logprobs
                else None
            ),
            "finish_reason": finish_reason,
            "stop_reason": choice.stop_reason,
        }
        for choice, (message, finish_reason) in zip(result.choices, messages, strict=True)
    ]
    return {
        "id": response_id,
        "object": "chat.completion",
        "created": created,
        "model": model_name,
        "choices": choices,
        "usage": usage_body([result]),
    }


def generation_body(
    response_id: str,
    created: int,
    model_name: str,
    prepared: PreparedGeneration,
    results: Sequence[PromptResult],
    decode_token: DecodeToken,
) -> dict[str, Any]:
    """The response body of a finished completions or chat request."""
    if prepared.kind == "chat":
        return chat_body(response_id, created, model_name, prepared, results[0], decode_token)
    return completion_body(response_id, created, model_name, prepared, results, decode_token)


def embedding_body(
    model_name: str, outputs: Sequence[EmbeddingRequestOutput], encoding_format: str
) -> dict[str, Any]:
    data = [
        {
            "object": "embedding",
            "index": index,
            "embedding": (
                base64_float32(output.outputs.embedding)
                if encoding_format == "base64"
                else list(output.outputs.embedding)
            ),
        }
        for index, output in enumerate(outputs)
    ]
    num_tokens = sum(len(output.prompt_token_ids) for output in outputs)
    return {
        "object": "list",
        "data": data,
        "model": model_name,
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
    }


def base64_float32(values: Sequence[float]) -> str:
    """OpenAI's base64 format: little-endian float32s, as numpy.frombuffer(..., "<f4") reads
    them."""
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")
