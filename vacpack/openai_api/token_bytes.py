"""A token's own UTF-8 bytes, for the `bytes` of chat logprobs.

OpenAI's `bytes` exist so that a client can rebuild characters split across tokens: an emoji
is often two or more byte-level tokens, each of which decodes alone to U+FFFD. Encoding the
decoded text gives U+FFFD's bytes and loses the character (vLLM does that); this reads the
token's bytes from the vocabulary instead, for the two byte-carrying vocabularies in use:
byte-level BPE (GPT-2, Llama 3, Qwen: each byte written as one printable character) and
SentencePiece with byte fallback (Llama 2, Gemma: `<0xE2>` tokens and `▁` for a space).
Any other vocabulary's tokens are whole characters, and their decoded text is their bytes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from functools import cache
from typing import Any

from transformers import PreTrainedTokenizerBase

# A token id and its decoded text -> the token's bytes.
TokenBytes = Callable[[int, str], bytes]

_BYTE_FALLBACK_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SENTENCEPIECE_SPACE = "\u2581"


@cache
def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable character -> the byte it stands for (GPT-2's table: printable
    bytes stand for themselves, the others are shifted past 255 in order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    shifted = (byte for byte in range(256) if byte not in printable)
    table = {chr(byte): byte for byte in printable}
    table.update({chr(256 + index): byte for index, byte in enumerate(shifted)})
    return table


def _decoder_types(tokenizer: PreTrainedTokenizerBase) -> set[str]:
    """The `type`s of the tokenizers library decoder's parts ({} for a slow tokenizer)."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None:
        return set()
    description: dict[str, Any] = json.loads(decoder.__getstate__())
    parts = description.get("decoders") or [description]
    return {str(part.get("type")) for part in parts}


def token_bytes_reader(tokenizer: PreTrainedTokenizerBase) -> TokenBytes:
    """Reads a token's bytes from the vocabulary where it carries them, else from its text."""
    decoders = _decoder_types(tokenizer)

    def as_text(token_id: int, text: str) -> bytes:
        return text.encode("utf-8")

    if "ByteLevel" in decoders:
        alphabet = _byte_level_alphabet()

        def byte_level(token_id: int, text: str) -> bytes:
            token = tokenizer.convert_ids_to_tokens(token_id)
            if not isinstance(token, str) or any(char not in alphabet for char in token):
                return as_text(token_id, text)  # an added token, written as itself
            return bytes(alphabet[char] for char in token)

        return byte_level
    if "ByteFallback" in decoders:

        def byte_fallback(token_id: int, text: str) -> bytes:
            token = tokenizer.convert_ids_to_tokens(token_id)
            if not isinstance(token, str):
                return as_text(token_id, text)
            byte = _BYTE_FALLBACK_TOKEN.fullmatch(token)
            if byte is not None:
                return bytes([int(byte.group(1), 16)])
            return token.replace(_SENTENCEPIECE_SPACE, " ").encode("utf-8")

        return byte_fallback
    return as_text
