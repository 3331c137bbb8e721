"""Prompts as the offline API takes them: text, token ids, or a prompt dict, typed under vLLM's
names (`from vllm.inputs import TokensPrompt` becomes `from vacpack.inputs import TokensPrompt`)
and read as plain dicts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypedDict, cast

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# A prompt is text, token ids, or a dict with "prompt" or "prompt_token_ids".
PromptType = str | Sequence[int] | Mapping[str, Any]
# vLLM's prompt dict keys for inputs vacpack does not take: refused, not silently dropped.
_UNSUPPORTED_PROMPT_KEYS = frozenset({"multi_modal_data", "mm_processor_kwargs", "prompt_embeds"})


class TextPrompt(TypedDict):
    """A prompt given as text, tokenized by the model's tokenizer."""

    prompt: str


class _TokenIds(TypedDict):
    prompt_token_ids: list[int]


class TokensPrompt(_TokenIds, total=False):
    """A prompt given as token ids; `prompt`, where given, is its text for the outputs."""

    prompt: str


def read_prompt_dict(prompt: Mapping[str, Any]) -> str | list[int]:
    """A vLLM prompt dict's token ids (`prompt_token_ids`), else its text (`prompt`)."""
    unread = set(prompt) & _UNSUPPORTED_PROMPT_KEYS
    if unread:
        raise ValueError(
            f"prompt keys {sorted(unread)} are not supported: vacpack reads text and "
            "token ids only (no images, audio or prompt embeddings)"
        )
    if "prompt_token_ids" in prompt:
        return list(prompt["prompt_token_ids"])
    if "prompt" in prompt:
        return cast(str, prompt["prompt"])
    raise ValueError("a prompt dict needs a 'prompt' or a 'prompt_token_ids' key")


def encode_prompt(
    prompt: PromptType, tokenizer: PreTrainedTokenizerBase, prompt_text: str | None = None
) -> tuple[str | None, list[int]]:
    """A prompt's text (where known; `prompt_text` for bare token ids) and its token ids."""
    if isinstance(prompt, Mapping):
        read = read_prompt_dict(prompt)
        if isinstance(read, str):
            return read, tokenizer.encode(read)
        return prompt.get("prompt", prompt_text), read
    if isinstance(prompt, str):
        return prompt, tokenizer.encode(prompt)
    return prompt_text, list(prompt)


def corpus_input(index: int, item: Any) -> Any:
    """A corpus job's input as its task reads it: a prompt dict becomes its text or ids."""
    if not isinstance(item, Mapping):
        return item
    try:
        return read_prompt_dict(item)
    except ValueError as error:
        raise ValueError(f"input {index}: {error}") from None


def as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    items = list(prompts)
    if items and isinstance(items[0], int):  # a single prompt given as token ids
        return [cast(list[int], items)]
    return cast(list[PromptType], items)
