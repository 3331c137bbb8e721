"""The request bodies we accept, as pydantic models, and parsing that fails with a 400.

Fields and defaults follow OpenAI's API, plus vLLM's sampling extras (top_k, min_p,
repetition_penalty, ignore_eos, ...). Types are strict (a string is not a number, true is not
1) because a client that sends the wrong type has a bug we should report, not guess around.
Unknown fields are accepted and ignored, as OpenAI-compatible servers do, so newer clients
keep working.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal, TypeVar, cast

from pydantic import BaseModel, ConfigDict, ValidationError

from vacpack.chat_turns import join_text_parts
from vacpack.openai_api.errors import bad_request

# A prompt (or an embedding input): text, texts, token ids, or lists of token ids.
PromptInput = str | list[str] | list[int] | list[list[int]]

# What a union-typed field must be, said once for the client instead of once per union branch.
_FIELD_SHAPES = {
    "prompt": "a string, a list of strings, a list of token ids, or a list of token-id lists",
    "input": "a string, a list of strings, a list of token ids, or a list of token-id lists",
    "stop": "a string or a list of strings",
    "content": 'a string or a list of text parts ({"type": "text", "text": ...}: images and '
    "other kinds of part are not read)",
    "tool_choice": 'one of "none", "auto", "required", or {"type": "function", "function": '
    '{"name": ...}}',
    "text_1": "a string or a list of strings",
    "text_2": "a string or a list of strings",
    "data_1": "a string or a list of strings",
    "data_2": "a string or a list of strings",
    "queries": "a string or a list of strings",
    "documents": "a string or a list of strings",
    "items": "a string or a list of strings",
}


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Body):
    include_usage: bool | None = False


class _GenerationRequest(_Body):
    """Fields common to completions and chat completions."""

    model: str | None = None
    n: int | None = None
    priority: int = 0  # vLLM's: lower first, under --scheduling-policy priority
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last k tokens
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extras: token-level controls and structured outputs.
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's older names for structured_outputs' constraints, which many clients still send
    # (output_constraints.GUIDED_FIELDS); the backend's name is taken and ignored: one engine
    # serves every constraint.
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None
    # vLLM's beam search: n beams, scored as LLM.beam_search scores them.
    use_beam_search: bool | None = False
    length_penalty: float | None = None

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_GenerationRequest):
    prompt: PromptInput
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None

    @property
    def num_prompts(self) -> int:
        return len(split_prompt_input(self.prompt))


class TextContentPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: str
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer to a call

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return join_text_parts(part.text for part in self.content)


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool | None = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    @property
    def num_prompts(self) -> int:
        return 1  # the conversation


def split_prompt_input(given: PromptInput) -> list[str | list[int]]:
    """One entry per prompt: a text, or a list of token ids (a flat id list is one prompt)."""
    if isinstance(given, str):
        return [given]
    items = cast(list[str | int | list[int]], given)
    if items and all(isinstance(item, int) for item in items):
        return [cast(list[int], list(items))]
    return [item if isinstance(item, str) else list(cast(list[int], item)) for item in items]


class EmbeddingRequest(_Body):
    model: str | None = None
    input: PromptInput
    encoding_format: Literal["float", "base64"] | None = "float"
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None  # vLLM's: keep each input's first k tokens
    user: str | None = None


class ClassificationRequest(_Body):
    """vLLM's /classify: label probabilities of each input, from a sequence classifier."""

    model: str | None = None
    input: PromptInput
    truncate_prompt_tokens: int | None = None  # vLLM's: keep each input's first k tokens
    user: str | None = None


class EncodeRequest(_Body):
    """vLLM's /pooling: LLM.encode over HTTP. `task` is a pooling task (token_embed, embed,
    classify); by default token_embed where the model embeds, classify for a classifier."""

    model: str | None = None
    input: PromptInput
    task: str | None = None
    encoding_format: Literal["float", "base64"] | None = "float"
    dimensions: int | None = None
    use_activation: bool | None = None
    truncate_prompt_tokens: int | None = None  # vLLM's: keep each input's first k tokens
    user: str | None = None


# vLLM's /score takes its two sides under any of these pairs of names.
SCORE_FIELD_PAIRS = (
    ("text_1", "text_2"),
    ("queries", "documents"),
    ("queries", "items"),
    ("data_1", "data_2"),
)


class ScoreRequest(_Body):
    model: str | None = None
    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None
    queries: str | list[str] | None = None
    documents: str | list[str] | None = None
    items: str | list[str] | None = None
    data_1: str | list[str] | None = None
    data_2: str | list[str] | None = None
    use_activation: bool | None = None
    truncate_prompt_tokens: int | None = None  # vLLM's: keep each pair's first k tokens
    user: str | None = None


class RerankRequest(_Body):
    model: str | None = None
    query: str
    documents: list[str]
    top_n: int | None = None  # 0 or None: every document
    use_activation: bool | None = None
    return_documents: bool | None = True
    truncate_prompt_tokens: int | None = None  # vLLM's: keep each pair's first k tokens
    user: str | None = None


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a `prompt`, or chat `messages` (and `tools`) rendered by the chat
    template, as chat completions render them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool | None = True
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = False


class LoadLoRAAdapterRequest(_Body):
    """vLLM's /v1/load_lora_adapter body."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(_Body):
    """vLLM's /v1/unload_lora_adapter body."""

    lora_name: str
    lora_int_id: int | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


Request = TypeVar("Request", bound=_Body)


def json_object(body: bytes | str) -> dict[str, Any]:
    """A request body decoded; APIError 400 unless it is a JSON object."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise bad_request(f"the request body is not valid JSON: {error}") from None
    except RecursionError:
        # The decoder's depth limit (the interpreter's recursion limit, about 1,000 levels),
        # far beyond any real request's.
        raise bad_request("the request body nests JSON arrays or objects too deeply") from None
    if not isinstance(data, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(data).__name__}")
    return data


def parse_body(model: type[Request], body: bytes | str | dict[str, Any]) -> Request:
    """A request model from raw JSON (or an already-decoded object); APIError 400 if invalid."""
    data = body if isinstance(body, dict) else json_object(body)
    if isinstance(body, dict | str) or _SURROGATE_ESCAPE.search(body):
        _check_unicode(data)
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise bad_request(*_describe(error)) from None


# JSON's escape for half of a UTF-16 surrogate pair, the only way raw JSON bytes can carry one
# (UTF-8 cannot encode it: such bytes already fail to decode). Bodies without it skip the walk.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _check_unicode(data: dict[str, Any]) -> None:
    """400 naming the first text (or object key) that holds a lone surrogate, such as JSON's
    "\\ud800" without its pair: such text is not Unicode, and the tokenizer, the chat template
    and the output file would each fail on it with a message the client cannot act on."""
    path = _lone_surrogate_path(data)
    if path is not None:
        # The key itself may be the bad text: it is shown escaped, so the message is valid text.
        param = ".".join(part.encode("utf-8", "backslashreplace").decode() for part in path)
        raise bad_request(
            f"{param} is not valid Unicode: it holds a lone surrogate (a \\ud800-\\udfff "
            "escape without its pair)",
            param,
        )


def _lone_surrogate_path(data: dict[str, Any]) -> list[str] | None:
    # A walk with its own stack, in document order: a body may nest as deep as the JSON decoder
    # allowed, which recursion here (called from deeper in the stack) might not.
    stack: list[tuple[list[str], Any]] = [([], data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if not is_unicode(value):
                return path
        elif isinstance(value, dict):
            for key, item in reversed(value.items()):
                stack.append(([*path, key], item))
                stack.append(([*path, key], key))  # the key itself, checked before its value
        elif isinstance(value, list):
            for index in range(len(value) - 1, -1, -1):
                # Only texts and containers: a long list of token ids costs no paths.
                if isinstance(value[index], str | dict | list):
                    stack.append(([*path, str(index)], value[index]))
    return None


def is_unicode(text: str) -> bool:
    """False for text holding a lone surrogate (which no Unicode encoding can write)."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_field(path: list[str]) -> bool:
    """Whether the location names a request field (or a message's content), not a key inside
    a mapping such as logit_bias, which may happen to share a field's name ("stop")."""
    return len(path) == 1 or (len(path) == 3 and path[0] == "messages" and path[2] == "content")


def _describe(error: ValidationError) -> tuple[str, str | None]:
    """(message, param) for the first field at fault."""
    first = error.errors(include_url=False)[0]
    if first["type"] == "missing":
        param = ".".join(str(part) for part in first["loc"])
        return f"{param} is required", param
    path: list[str] = []
    for part in first["loc"]:
        path.append(str(part))
        if part in _FIELD_SHAPES and _is_field(path):
            # A union field: the rest of the location names union branches, noise to a client.
            param = ".".join(path)
            return f"{param} must be {_FIELD_SHAPES[str(part)]}", param
    location = ".".join(path)
    return f"{location}: {first['msg']}", location or None
