"""Text into the engine: loading a tokenizer, its EOS ids, and chat prompts as token ids.

Text out of the engine (incremental detokenization and stop strings) is in detokenizer.py.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

from huggingface_hub.errors import HFValidationError
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from vacpack.errors import TokenizerLoadError, TokenizerNotFoundError

GENERATION_CONFIG_FILENAME = "generation_config.json"
TOKENIZER_FILE_EXAMPLES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
)


def decode_text(tokenizer: PreTrainedTokenizerBase, token_ids: list[int], **options: Any) -> str:
    """The text of one sequence of token ids (`decode` is typed for batches too)."""
    text = tokenizer.decode(token_ids, **options)
    assert isinstance(text, str), "one sequence of ids decodes to one string"
    return text


def plain_decoder(
    tokenizer: PreTrainedTokenizerBase, *, skip_special_tokens: bool
) -> Callable[[list[int]], str]:
    """Decodes one sequence of ids, spaces not cleaned up: `decode_text` with those options.

    For a fast tokenizer that does not override how it decodes, that is the tokenizers library's
    own decode, called here directly: transformers' wrapper around it costs ten times the decode
    itself (~12 us a call), and incremental detokenization calls it for every sequence of every
    step (3 ms a step for 256 sequences)."""
    if (
        isinstance(tokenizer, PreTrainedTokenizerFast)
        and type(tokenizer)._decode is PreTrainedTokenizerFast._decode
    ):
        return partial(tokenizer.backend_tokenizer.decode, skip_special_tokens=skip_special_tokens)
    return partial(
        decode_text,
        tokenizer,
        skip_special_tokens=skip_special_tokens,
        clean_up_tokenization_spaces=False,
    )


def _not_found_message(name_or_path: str) -> str:
    return (
        f"Cannot load a tokenizer for {name_or_path!r}: it is neither a local directory nor "
        "available offline (it is not in the Hugging Face cache, and the Hub could not be "
        "reached or has no such repository)."
    )


def _looks_like_local_path(name_or_path: str) -> bool:
    # Hub ids are "name" or "org/name"; anything absolute or relative-looking is meant as a path,
    # and sending it to the Hub would only add a confusing repo-id validation error.
    return os.path.isabs(name_or_path) or name_or_path.startswith((".", "~"))


def load_tokenizer(
    name_or_path: str, *, trust_remote_code: bool = False, revision: str | None = None
) -> PreTrainedTokenizerBase:
    """Load a tokenizer from a local model directory or a Hub id (cache or network).

    Raises TokenizerNotFoundError (a ValueError) when the name is neither a local directory nor
    reachable, and TokenizerLoadError when a local directory exists but holds no usable
    tokenizer. Other errors (such as a repo that needs trust_remote_code) propagate unchanged.
    """
    local_path = Path(name_or_path).expanduser()
    if local_path.is_dir():
        try:
            tokenizer = AutoTokenizer.from_pretrained(
                str(local_path), trust_remote_code=trust_remote_code, revision=revision
            )
        except (OSError, ValueError) as error:
            raise TokenizerLoadError(
                f"{name_or_path!r} is a local directory, but no tokenizer could be loaded from "
                f"it: {error}"
            ) from error
        # Without its files transformers still builds the class config.json names, with an
        # empty vocabulary that turns every prompt into zero tokens.
        if len(tokenizer.get_vocab()) <= 1:
            raise TokenizerLoadError(
                f"{name_or_path!r} is a local directory, but has no tokenizer files (such as "
                f"{', '.join(TOKENIZER_FILE_EXAMPLES)}): its tokenizer has an empty vocabulary"
            )
        return tokenizer
    if _looks_like_local_path(name_or_path) or local_path.exists():
        raise TokenizerNotFoundError(_not_found_message(name_or_path))
    try:
        return AutoTokenizer.from_pretrained(
            name_or_path, trust_remote_code=trust_remote_code, revision=revision
        )
    # transformers reports a missing or unreachable repo as OSError (huggingface_hub's
    # not-found, offline and HTTP errors all subclass it); a malformed id is HFValidationError.
    except (OSError, HFValidationError) as error:
        raise TokenizerNotFoundError(_not_found_message(name_or_path)) from error


def _token_id_set(value: Any, source: str) -> set[int]:
    if value is None:
        return set()
    values = value if isinstance(value, list | tuple) else [value]
    # bool is an int subclass, but `true` as a token id is a broken config, not token 1.
    if not all(isinstance(item, int) and not isinstance(item, bool) for item in values):
        raise ValueError(f"eos_token_id in {source} must be an int or a list of ints: {value!r}")
    return set(values)


def eos_token_ids(
    tokenizer: PreTrainedTokenizerBase, model_dir: str | Path | None
) -> frozenset[int]:
    """Every id that ends generation: the tokenizer's eos plus generation_config.json's.

    Chat models often list several ids in generation_config.json (e.g. <|im_end|> as well as
    <|endoftext|>) while the tokenizer knows only one. model_dir must be a local directory
    (a resolved snapshot); when it is None or has no generation_config.json, only the
    tokenizer's id is used.
    """
    token_ids = _token_id_set(tokenizer.eos_token_id, "the tokenizer")
    if model_dir is not None:
        config_path = Path(model_dir) / GENERATION_CONFIG_FILENAME
        if config_path.is_file():
            generation_config = json.loads(config_path.read_text(encoding="utf-8"))
            token_ids |= _token_id_set(generation_config.get("eos_token_id"), str(config_path))
    return frozenset(token_ids)


def _as_token_id_list(template_output: Any) -> list[int]:
    # transformers 5 returns a BatchEncoding (a Mapping) unless return_dict=False is honoured,
    # and some versions nest a single conversation in a batch of one.
    if isinstance(template_output, Mapping):
        template_output = template_output["input_ids"]
    if hasattr(template_output, "tolist"):
        template_output = template_output.tolist()
    token_ids = list(template_output)
    if token_ids and isinstance(token_ids[0], list | tuple):
        if len(token_ids) != 1:
            raise ValueError(f"expected one tokenized conversation, got {len(token_ids)}")
        token_ids = list(token_ids[0])
    return [int(token_id) for token_id in token_ids]


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase,
    conversation: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    **kwargs: Any,
) -> list[int]:
    """Render a chat conversation with the tokenizer's (or the given) template into token ids.

    Extra keyword arguments (tools, documents, template variables) go to transformers'
    apply_chat_template. Raises ValueError when there is no template to render with.
    """
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            f"The tokenizer of {tokenizer.name_or_path!r} has no chat template; pass "
            "chat_template=... or send a plain-text prompt instead of a conversation."
        )
    template_output = tokenizer.apply_chat_template(
        conversation,
        add_generation_prompt=add_generation_prompt,
        chat_template=chat_template,
        tokenize=True,
        return_dict=False,
        **kwargs,
    )
    return _as_token_id_list(template_output)
