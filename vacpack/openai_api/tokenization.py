"""/tokenize and /detokenize, in vLLM's request and response shapes."""

from __future__ import annotations

from typing import Any

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from vacpack.openai_api.errors import bad_request
from vacpack.openai_api.protocol import DetokenizeRequest, TokenizeRequest
from vacpack.tokenizer import apply_chat_template


def tokenize_body(
    request: TokenizeRequest, tokenizer: PreTrainedTokenizerBase, max_model_len: int
) -> dict[str, Any]:
    """{"count", "max_model_len", "tokens", "token_strs"} for a prompt or chat messages."""
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
        conversation = [
            {"role": message.role, "content": message.text()} for message in request.messages or []
        ]
        try:
            token_ids = apply_chat_template(
                tokenizer,
                conversation,
                add_generation_prompt=request.add_generation_prompt is not False,
                **(request.chat_template_kwargs or {}),
            )
        except (TemplateError, ValueError, TypeError, RecursionError) as error:
            message = f"the chat template could not render messages: {error}"
            raise bad_request(message, "messages") from None
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
