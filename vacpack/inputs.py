"""Typed prompt dicts, under vLLM's names (`from vllm.inputs import TokensPrompt` becomes
`from vacpack.inputs import TokensPrompt`): `LLM.generate` reads them as plain dicts."""

from __future__ import annotations

from typing import TypedDict


class TextPrompt(TypedDict):
    """A prompt given as text, tokenized by the model's tokenizer."""

    prompt: str


class _TokenIds(TypedDict):
    prompt_token_ids: list[int]


class TokensPrompt(_TokenIds, total=False):
    """A prompt given as token ids; `prompt`, where given, is its text for the outputs."""

    prompt: str
