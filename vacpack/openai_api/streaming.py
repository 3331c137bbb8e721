"""Engine delta outputs -> OpenAI stream chunks (completions and chat completions).

Each chunk carries one choice's new text, so concatenating a choice's streamed text gives
exactly the non-streamed text: both come from the same engine deltas, which never include text
a stop string could still cut.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from vacpack.openai_api.logprobs import CompletionLogprobs, DecodeToken, chat_logprobs_content
from vacpack.openai_api.requests import PreparedGeneration
from vacpack.openai_api.responses import PromptResult, tool_calls_finish_reason, usage_body
from vacpack.openai_api.tool_streaming import ToolCallStream
from vacpack.outputs import RequestOutput


@dataclass
class StreamState:
    """What a stream has sent so far, per (prompt, choice), beyond the accumulated results."""

    response_id: str
    created: int
    model_name: str
    prepared: PreparedGeneration
    results: list[PromptResult]
    decode_token: DecodeToken
    started_choices: set[tuple[int, int]] = field(default_factory=set)
    text_offsets: dict[tuple[int, int], int] = field(default_factory=dict)
    tool_streams: dict[int, ToolCallStream] = field(default_factory=dict)  # per chat choice

    @property
    def _usage_field(self) -> dict[str, Any]:
        # With include_usage, every chunk has "usage": null except the last, as OpenAI sends.
        return {"usage": None} if self.prepared.include_usage_in_stream else {}

    def _chunk(self, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": object_name,
            "created": self.created,
            "model": self.model_name,
            "choices": choices,
            **self._usage_field,
        }

    def usage_chunk(self) -> dict[str, Any] | None:
        if not self.prepared.include_usage_in_stream:
            return None
        object_name = "chat.completion.chunk" if self.prepared.kind == "chat" else "text_completion"
        return {**self._chunk(object_name, []), "usage": usage_body(self.results)}

    # ---------------------------------------------------------------- completions
    def completion_chunks(self, prompt_index: int, output: RequestOutput) -> Iterator[dict]:
        result = self.results[prompt_index]
        n = self.prepared.num_choices_per_prompt
        for delta in result.add_delta(output):
            key = (prompt_index, delta.index)
            first = key not in self.started_choices
            self.started_choices.add(key)
            text = delta.text
            logprobs = None
            if self.prepared.want_logprobs:
                logprobs, text_offset = self._completion_logprobs(
                    result, delta.token_ids, delta.logprobs or [], first, key
                )
                self.text_offsets[key] = text_offset
            if first and self.prepared.echo:
                text = (result.prompt.text or "") + text
            if not text and logprobs is None and delta.finish_reason is None:
                continue
            choice = {
                "index": prompt_index * n + delta.index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": delta.finish_reason,
                "stop_reason": delta.stop_reason,
            }
            yield self._chunk("text_completion", [choice])

    def _completion_logprobs(
        self,
        result: PromptResult,
        token_ids: Sequence[int],
        positions: Sequence[Any],
        first: bool,
        key: tuple[int, int],
    ) -> tuple[dict[str, Any], int]:
        logprobs = CompletionLogprobs.empty()
        offset = self.text_offsets.get(key, 0)
        if first and self.prepared.echo:
            prompt_positions = result.prompt_logprobs or [None] * result.num_prompt_tokens
            offset = logprobs.add_positions(
                result.prompt.token_ids, prompt_positions, self.decode_token, offset
            )
        offset = logprobs.add_positions(token_ids, positions, self.decode_token, offset)
        return logprobs.to_json(), offset

    # ---------------------------------------------------------------- chat
    def chat_role_chunks(self) -> Iterator[dict]:
        """The first chunk of each choice: the assistant role and empty content."""
        for index in range(self.prepared.num_choices_per_prompt):
            yield self._chunk(
                "chat.completion.chunk",
                [
                    {
                        "index": index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            )

    def chat_chunks(self, output: RequestOutput) -> Iterator[dict]:
        num_top = self.prepared.params.logprobs or 0
        for delta in self.results[0].add_delta(output):
            logprobs = None
            if self.prepared.want_logprobs:
                logprobs = {
                    "content": chat_logprobs_content(
                        delta.token_ids, delta.logprobs or [], num_top, self.decode_token
                    )
                }
            message, finish_reason = self._chat_delta(delta.index, delta.text, delta.finish_reason)
            if not message and finish_reason is None and logprobs is None:
                continue
            choice = {
                "index": delta.index,
                "delta": message,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
                "stop_reason": delta.stop_reason,
            }
            yield self._chunk("chat.completion.chunk", [choice])

    def _chat_delta(
        self, index: int, text: str, finish_reason: str | None
    ) -> tuple[dict[str, Any], str | None]:
        """The delta message for new text, split into content and tool calls with tools."""
        parser = self.prepared.tool_parser
        if parser is None:
            return ({"content": text} if text else {}), finish_reason
        max_calls = None if self.prepared.parallel_tool_calls else 1
        stream = self.tool_streams.setdefault(index, ToolCallStream(parser, max_calls))
        content, calls = stream.feed(text, finished=finish_reason is not None)
        message: dict[str, Any] = {"content": content} if content else {}
        if calls:
            message["tool_calls"] = stream.call_deltas(calls)
        if stream.calls_sent:
            finish_reason = tool_calls_finish_reason(finish_reason)
        return message, finish_reason
