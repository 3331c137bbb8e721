"""A token's own bytes for chat logprobs' `bytes`: from byte-level BPE, SentencePiece byte
fallback and WordPiece vocabularies, such that a character split across tokens is rebuilt."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from vacpack.openai_api.token_bytes import token_bytes_reader
from vacpack.tokenizer import decode_text

TEXT = "naïve 😀 café"


def _joined_bytes(tokenizer: PreTrainedTokenizerBase, token_ids: list[int]) -> bytes:
    read = token_bytes_reader(tokenizer)
    return b"".join(read(token_id, decode_text(tokenizer, [token_id])) for token_id in token_ids)


def test_byte_level_bpe_tokens_give_their_bytes(byte_level_tokenizer) -> None:
    token_ids = byte_level_tokenizer.encode(TEXT, add_special_tokens=False)
    alone = [decode_text(byte_level_tokenizer, [token_id]) for token_id in token_ids]
    assert any("\ufffd" in piece for piece in alone), "a character must be split across tokens"
    assert _joined_bytes(byte_level_tokenizer, token_ids) == TEXT.encode()


def _sentencepiece_with_byte_fallback() -> PreTrainedTokenizerFast:
    # Llama 2's scheme: characters of the vocabulary, any other byte as a <0xHH> token.
    characters = ["<unk>", "\u2581", *"naivecf"]
    vocab = {token: index for index, token in enumerate(characters)}
    vocab.update({f"<0x{byte:02X}>": len(characters) + byte for byte in range(256)})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    backend.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def test_byte_fallback_tokens_give_their_bytes() -> None:
    tokenizer = _sentencepiece_with_byte_fallback()
    token_ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert "<0xF0>" in tokenizer.convert_ids_to_tokens(token_ids)
    # The first token's "▁" is the space Metaspace put before the text.
    assert _joined_bytes(tokenizer, token_ids) == b" " + TEXT.encode()


def test_wordpiece_tokens_are_whole_characters(bert) -> None:
    token_ids = bert.encode("naive cafe", add_special_tokens=False)
    read = token_bytes_reader(bert)
    for token_id in token_ids:
        text = decode_text(bert, [token_id])
        assert read(token_id, text) == text.encode()
