"""/tokenize and /detokenize, in vLLM's request and response shapes."""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

from vacpack.openai_api.errors import bad_request
from vacpack.openai_api.protocol import ChatCompletionRequest, DetokenizeRequest, TokenizeRequest
from vacpack.openai_api.requests import render_chat


def tokenize_body(
    request: TokenizeRequest,
    tokenizer: PreTrainedTokenizerBase,
    max_model_len: int,
    tool_call_parser: str = "auto",
) -> dict[str, Any]:
    """{"count", "max_model_len", "tokens", "token_strs"} for a prompt or chat messages; the
    messages' count is the prompt_tokens a chat completion of them reports."""
    if (request.prompt is None) == (request.messages is None):
        raise bad_request("give either prompt or messages", "prompt")
    if request.prompt is not None:
        add_special_tokens = request.add_special_tokens is not False
        token_ids = tokenizer.encode(request.prompt, add_special_tokens=add_special_tokens)
    else:
        if request.add_special_tokens:
            raise bad_request(
                "add_special_tokens applies to a prompt; the chat template places the special "
                "tokens of messages",
                "add_special_tokens",
            )
        chat = ChatCompletionRequest(
            messages=request.messages or [],
            tools=request.tools,
            add_generation_prompt=request.add_generation_prompt,
            chat_template_kwargs=request.chat_template_kwargs,
        )
        token_ids, _ = render_chat(chat, tokenizer, tool_call_parser)
    return {
        "count": len(token_ids),
        "max_model_len": max_model_len,
        "tokens": list(token_ids),
        "token_strs": (
            tokenizer.convert_ids_to_tokens(list(token_ids)) if request.return_token_strs else None
        ),
    }


def detokenize_body(
    request: DetokenizeRequest, tokenizer: PreTrainedTokenizerBase
) -> dict[str, Any]:
    """{"prompt": the text of the token ids}; a 400 for an id outside the vocabulary."""
    vocab_size = len(tokenizer)
    for index, token_id in enumerate(request.tokens):
        if not 0 <= token_id < vocab_size:
            raise bad_request(
                f"tokens {index}: {token_id} is not a token id (the vocabulary has {vocab_size})",
                "tokens",
            )
    return {"prompt": tokenizer.decode(request.tokens)}
