"""A parsed OpenAI request -> what the engine runs: prompts as token ids and SamplingParams.

Every check a request can fail before it reaches the engine lives here, so the server and batch
files refuse the same requests with the same messages.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from types import MappingProxyType
from typing import Any, Literal

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from vacpack.beam_search import BeamSearchParams
from vacpack.chat_turns import called_function
from vacpack.engine.request import check_priority
from vacpack.errors import RequestFieldError
from vacpack.lora.request import LoRARequest
from vacpack.openai_api.beam_search_request import beam_search_params
from vacpack.openai_api.errors import APIError, bad_request
from vacpack.openai_api.message_checks import check_messages
from vacpack.openai_api.output_constraints import (
    ToolPlan,
    plan_tools,
    structured_outputs,
    token_controls,
)
from vacpack.openai_api.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ClassificationRequest,
    CompletionRequest,
    EmbeddingRequest,
    EncodeRequest,
    PromptInput,
    parse_body,
    split_prompt_input,
)
from vacpack.openai_api.tool_parsers import ToolParser, tool_parser
from vacpack.outputs import RequestOutputKind
from vacpack.sampling import SamplingParams
from vacpack.tokenizer import apply_chat_template, decode_text

_SAMPLING_FIELD_NAMES = {f.name for f in fields(SamplingParams)}
NO_DEFAULTS: Mapping[str, Any] = MappingProxyType({})


GenerationKind = Literal["completion", "chat"]

# The endpoints that generate, by URL path (batch files name them so).
GENERATION_URLS: dict[str, GenerationKind] = {
    "/v1/completions": "completion",
    "/v1/chat/completions": "chat",
}
RESPONSE_ID_PREFIXES: dict[GenerationKind, str] = {"completion": "cmpl", "chat": "chatcmpl"}


@dataclass(frozen=True)
class EnginePrompt:
    """One prompt as the engine takes it. `text` is None unless given or needed for echo."""

    token_ids: list[int]
    text: str | None = None


@dataclass(frozen=True)
class PreparedGeneration:
    """A completions or chat request, ready for the engine: one engine request per prompt."""

    kind: GenerationKind
    prompts: list[EnginePrompt]
    params: SamplingParams
    echo: bool  # completions only: the prompt's text (and logprobs) lead each choice
    want_logprobs: bool
    stream: bool
    include_usage_in_stream: bool
    # Chat with tools (tool_choice not "none"): splits each choice into content and tool calls.
    tool_parser: ToolParser | None = None
    parallel_tool_calls: bool = True  # False: a choice keeps its first call only
    # use_beam_search: each prompt's n best beams are its choices (params then only checked).
    beam_search: BeamSearchParams | None = None
    lora_request: LoRARequest | None = None  # the adapter the request's `model` names
    priority: int = 0  # its place under priority scheduling (lower first)

    @property
    def num_choices_per_prompt(self) -> int:
        return self.params.n


def parse_generation(
    kind: GenerationKind, body: bytes | str | dict[str, Any]
) -> CompletionRequest | ChatCompletionRequest:
    """A completions or chat request body, parsed and checked field by field."""
    if kind == "chat":
        return parse_body(ChatCompletionRequest, body)
    return parse_body(CompletionRequest, body)


def prepare_generation(
    request: CompletionRequest | ChatCompletionRequest,
    tokenizer: PreTrainedTokenizerBase,
    max_model_len: int,
    output_kind: RequestOutputKind,
    tool_call_parser: str = "auto",
    sampling_defaults: Mapping[str, Any] = NO_DEFAULTS,
    scheduling_policy: str = "fcfs",
) -> PreparedGeneration:
    """What the engine runs for a parsed completions or chat request (tool_call_parser: see
    prepare_chat; sampling_defaults: SamplingParams fields for those the request leaves out,
    the model's recommended sampling, generation_defaults.py; scheduling_policy: the engine's,
    which says whether a `priority` other than 0 may be honoured)."""
    try:
        check_priority(request.priority, scheduling_policy)
    except ValueError as error:
        raise bad_request(str(error), "priority") from None
    if isinstance(request, ChatCompletionRequest):
        prepared = prepare_chat(
            request,
            tokenizer,
            max_model_len,
            output_kind,
            tool_call_parser=tool_call_parser,
            sampling_defaults=sampling_defaults,
        )
    else:
        prepared = prepare_completion(
            request, tokenizer, max_model_len, output_kind, sampling_defaults=sampling_defaults
        )
    return replace(prepared, priority=request.priority)


def prepare_completion(
    request: CompletionRequest,
    tokenizer: PreTrainedTokenizerBase,
    max_model_len: int,
    output_kind: RequestOutputKind,
    sampling_defaults: Mapping[str, Any] = NO_DEFAULTS,
) -> PreparedGeneration:
    if request.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if request.best_of is not None and request.best_of != (request.n or 1):
        raise bad_request("best_of is not supported (only best_of == n)", "best_of")
    echo = bool(request.echo)
    prompts = [
        EnginePrompt(
            token_ids, text if text is not None or not echo else decode_text(tokenizer, token_ids)
        )
        for text, token_ids in _tokenize_prompts(request.prompt, tokenizer, "prompt")
    ]
    params = _sampling_params(
        request,
        max_tokens=request.max_tokens,
        logprobs=request.logprobs,
        prompt_logprobs=request.logprobs if echo else None,
        output_kind=output_kind,
        renamed={"prompt_logprobs": "logprobs"},
        extra={"structured_outputs": structured_outputs(request)},
        defaults=sampling_defaults,
    )
    for index, prompt in enumerate(prompts):
        token_ids = _truncated_prompt(params, prompt.token_ids, max_model_len)
        if len(token_ids) < len(prompt.token_ids):  # an echo shows what the model read
            text = decode_text(tokenizer, token_ids) if echo else prompt.text
            prompts[index] = prompt = EnginePrompt(token_ids, text)
        where = f"prompt {index}" if len(prompts) > 1 else "the prompt"
        check_context(len(prompt.token_ids), params.max_tokens, max_model_len, where, "prompt")
    longest_prompt = max((len(prompt.token_ids) for prompt in prompts), default=0)
    return PreparedGeneration(
        kind="completion",
        prompts=prompts,
        params=params,
        echo=echo,
        want_logprobs=request.logprobs is not None,
        stream=bool(request.stream),
        include_usage_in_stream=request.include_usage_in_stream,
        beam_search=beam_search_params(request, params.max_tokens, longest_prompt, max_model_len),
    )


def prepare_chat(
    request: ChatCompletionRequest,
    tokenizer: PreTrainedTokenizerBase,
    max_model_len: int,
    output_kind: RequestOutputKind,
    tool_call_parser: str = "auto",
    sampling_defaults: Mapping[str, Any] = NO_DEFAULTS,
) -> PreparedGeneration:
    """tool_call_parser: a name from tool_parsers.TOOL_CALL_PARSERS ("auto": from the chat
    template)."""
    if request.top_logprobs is not None and not request.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    token_ids, tool_plan = render_chat(request, tokenizer, tool_call_parser)
    max_tokens_field = "max_tokens"
    max_tokens = request.max_tokens
    if request.max_completion_tokens is not None:
        max_tokens_field, max_tokens = "max_completion_tokens", request.max_completion_tokens
    params = _sampling_params(
        request,
        max_tokens=max_tokens,
        logprobs=(request.top_logprobs or 0) if request.logprobs else None,
        prompt_logprobs=None,
        output_kind=output_kind,
        renamed={"logprobs": "top_logprobs", "max_tokens": max_tokens_field},
        defaults=sampling_defaults,
        extra={
            "structured_outputs": structured_outputs(request, tool_plan),
            # A tool call's markers may be special tokens: the parser must see them.
            **(
                {"skip_special_tokens": False}
                if tool_plan.parser is not None and request.skip_special_tokens is None
                else {}
            ),
        },
    )
    token_ids = _truncated_prompt(params, token_ids, max_model_len)
    check_context(len(token_ids), params.max_tokens, max_model_len, "the messages", "messages")
    return PreparedGeneration(
        kind="chat",
        prompts=[EnginePrompt(token_ids)],
        params=params,
        echo=False,
        want_logprobs=bool(request.logprobs),
        stream=bool(request.stream),
        include_usage_in_stream=request.include_usage_in_stream,
        tool_parser=tool_plan.parser,
        parallel_tool_calls=tool_plan.parallel,
        beam_search=beam_search_params(request, params.max_tokens, len(token_ids), max_model_len),
    )


def _truncated_prompt(
    params: SamplingParams, token_ids: list[int], max_model_len: int
) -> list[int]:
    """The prompt the model reads (SamplingParams.truncate_prompt, which holds the rule); a 400
    naming truncate_prompt_tokens where it is above the model's context."""
    try:
        return params.truncate_prompt(token_ids, max_model_len)
    except ValueError as error:
        raise bad_request(str(error), "truncate_prompt_tokens") from None


def render_chat(
    request: ChatCompletionRequest,
    tokenizer: PreTrainedTokenizerBase,
    tool_call_parser: str = "auto",
) -> tuple[list[int], ToolPlan]:
    """The token ids the chat template makes of a request's messages and tools, and how the
    tools are to be used; 400 for malformed messages or tools, or a template that fails on them.
    Chat completions and /tokenize both render through here, so that both count alike."""
    parser = tool_parser(tool_call_parser, tokenizer) if request.tools else None
    tool_plan = plan_tools(request, parser)
    if not request.messages:
        raise bad_request("messages must not be empty", "messages")
    check_messages(request.messages)
    conversation = [
        _template_turn(index, message) for index, message in enumerate(request.messages)
    ]
    template_kwargs = dict(request.chat_template_kwargs or {})
    if tool_plan.tools is not None:
        template_kwargs["tools"] = tool_plan.tools
    try:
        token_ids = apply_chat_template(
            tokenizer,
            conversation,
            add_generation_prompt=request.add_generation_prompt is not False,
            **template_kwargs,
        )
    # RecursionError: tool arguments or template kwargs nested deeper than tojson can write.
    except (TemplateError, ValueError, TypeError, RecursionError) as error:
        problem = f"the chat template could not render messages: {error}"
        raise bad_request(problem, "messages") from None
    return token_ids, tool_plan


def _template_turn(index: int, message: ChatMessage) -> dict[str, Any]:
    """Message `index` as chat templates read it: an earlier call's arguments as an object
    (OpenAI sends them as JSON text; templates such as Qwen's write them out with tojson)."""
    where = f"messages.{index}"
    turn: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.name is not None:
        turn["name"] = message.name
    if message.tool_call_id is not None:
        turn["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        calls = []
        for call_index, call in enumerate(message.tool_calls):
            param = f"{where}.tool_calls.{call_index}.function"
            try:
                calls.append({**call, "function": called_function(call.get("function"), param)})
            except RequestFieldError as error:
                raise bad_request(str(error), error.field) from None
        turn["tool_calls"] = calls
    return turn


def prepare_embedding(
    request: EmbeddingRequest | ClassificationRequest | EncodeRequest,
) -> list[str | list[int]]:
    """The inputs to embed or classify, as texts or token-id lists (the job tokenizes text)."""
    inputs = split_prompt_input(request.input)
    if not inputs:
        raise bad_request("input must not be an empty list", "input")
    for index, item in enumerate(inputs):
        if not (item.strip() if isinstance(item, str) else item):
            raise bad_request(f"input {index} is empty", "input")
    return inputs


def check_context(
    num_prompt_tokens: int,
    max_tokens: int | None,
    max_model_len: int,
    where: str,
    param: str,
) -> None:
    """400 unless the prompt plus the tokens asked for fit in the context, as OpenAI checks."""
    if num_prompt_tokens == 0:
        raise bad_request(f"{where} is empty: give at least one token", param)
    if not max_tokens:  # none given, or 0 (echo alone): the engine still keeps one position
        if num_prompt_tokens >= max_model_len:
            raise bad_request(
                f"This model's maximum context length is {max_model_len} tokens, and {where} "
                f"has {num_prompt_tokens} tokens: at most {max_model_len - 1} prompt tokens "
                "leave room for one output token. Shorten the prompt.",
                param,
            )
        return
    if num_prompt_tokens + max(max_tokens, 1) > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in "
            f"{where}, {max_tokens} in the completion). Shorten the prompt or max_tokens.",
            param,
        )


def _tokenize_prompts(
    prompt: PromptInput, tokenizer: PreTrainedTokenizerBase, param: str
) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) for each prompt in a prompt input."""
    prompts = split_prompt_input(prompt)
    if not prompts:
        raise bad_request(f"{param} must not be an empty list", param)
    return [
        (item, tokenizer.encode(item)) if isinstance(item, str) else (None, item)
        for item in prompts
    ]


def _sampling_params(
    request: CompletionRequest | ChatCompletionRequest,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None,
    output_kind: RequestOutputKind,
    renamed: dict[str, str],
    extra: dict[str, Any],
    defaults: Mapping[str, Any],
) -> SamplingParams:
    """SamplingParams from the request (and `extra` fields); a field it leaves out (None) takes
    `defaults`' value (the model's recommended sampling), else SamplingParams' default.

    `renamed` maps a SamplingParams field to the request field it came from, so a 400 names
    the field the client actually sent.
    """
    given: dict[str, Any] = {
        "n": request.n,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "min_p": request.min_p,
        "seed": request.seed,
        "stop": request.stop,
        "stop_token_ids": request.stop_token_ids,
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
        "repetition_penalty": request.repetition_penalty,
        "ignore_eos": request.ignore_eos,
        "min_tokens": request.min_tokens,
        "include_stop_str_in_output": request.include_stop_str_in_output,
        "skip_special_tokens": request.skip_special_tokens,
        "truncate_prompt_tokens": request.truncate_prompt_tokens,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        **token_controls(request),
        **extra,
    }
    kwargs = {name: value for name, value in given.items() if value is not None}
    kwargs = {**{k: v for k, v in defaults.items() if k != "max_tokens"}, **kwargs}
    if max_tokens is None:
        max_tokens = defaults.get("max_tokens")
    try:
        return SamplingParams(max_tokens=max_tokens, output_kind=output_kind, **kwargs)
    except ValueError as error:
        message = str(error)
        field_name = message.split(" ", 1)[0]
        if field_name not in _SAMPLING_FIELD_NAMES:
            raise bad_request(message) from None
        param = renamed.get(field_name, field_name)
        raise APIError(
            400, message.replace(field_name, param, 1), param=param, code="invalid_value"
        ) from None
