"""Tests for vacpack.detokenizer: incremental detokenization, stop strings, streaming."""

from __future__ import annotations

import json
import random
from collections.abc import Callable

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

import vacpack.detokenizer as detokenizer_module
from vacpack.detokenizer import IncrementalDetokenizer, RequestDetokenizer, StopStringMatcher
from vacpack.tokenizer import plain_decoder

# Multi-byte text of every UTF-8 length: 2 bytes (é, ü), 3 bytes (CJK), 4 bytes (emoji).
MULTI_BYTE_WORDS = ("café", "naïve", "über", "中文", "汉字", "😀", "🚀🌍", "e\u0301")


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's byte-to-symbol table, which the ByteLevel pre-tokenizer uses for its base tokens.
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    symbols = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            symbols.append(256 + extra)
            extra += 1
    return {byte: chr(symbol) for byte, symbol in zip(printable, symbols, strict=True)}


BYTE_SYMBOLS = _bytes_to_unicode()


# ---------------------------------------------------------------- incremental detokenizer


def _detokenize_in_chunks(
    detokenizer: IncrementalDetokenizer, token_ids: list[int], rng: random.Random
) -> list[str]:
    deltas: list[str] = []
    position = 0
    while position < len(token_ids):
        chunk_len = rng.choice((1, 1, 1, 2, 3))
        deltas.append(detokenizer.decode_next(token_ids[position : position + chunk_len]))
        position += chunk_len
    deltas.append(detokenizer.flush())
    return deltas


def _byte_token_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """One base token per UTF-8 byte, so multi-byte characters are split across tokens."""
    token_ids = tokenizer.convert_tokens_to_ids([BYTE_SYMBOLS[b] for b in text.encode("utf-8")])
    assert tokenizer.unk_token_id is None or tokenizer.unk_token_id not in token_ids
    return token_ids


def _random_token_ids(tokenizer: PreTrainedTokenizerBase, rng: random.Random) -> list[int]:
    vocab_size = len(tokenizer)
    token_ids: list[int] = []
    for _ in range(rng.randint(1, 12)):
        kind = rng.random()
        word = rng.choice(MULTI_BYTE_WORDS)
        if kind < 0.35:
            token_ids.extend(rng.randrange(vocab_size) for _ in range(rng.randint(1, 4)))
        elif kind < 0.65:
            token_ids.extend(_byte_token_ids(tokenizer, word))
        elif kind < 0.9:
            token_ids.extend(tokenizer.encode(" " + word, add_special_tokens=False))
        else:
            # Only part of a character: the sequence may end mid-character, or be followed by
            # bytes that break it.
            word_bytes = _byte_token_ids(tokenizer, word)
            token_ids.extend(word_bytes[: rng.randint(1, len(word_bytes))])
    return token_ids


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("spaces_between_special_tokens", [True, False])
def test_deltas_concatenate_to_decode_byte_level(
    byte_level_tokenizer: PreTrainedTokenizerBase,
    skip_special_tokens: bool,
    spaces_between_special_tokens: bool,
) -> None:
    # A byte-level decoder adds no spaces of its own, so both settings match decode().
    tokenizer = byte_level_tokenizer
    rng = random.Random(1234 + skip_special_tokens + 2 * spaces_between_special_tokens)
    for _ in range(150):
        token_ids = _random_token_ids(tokenizer, rng)
        detokenizer = IncrementalDetokenizer(
            tokenizer,
            skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=spaces_between_special_tokens,
        )
        deltas = _detokenize_in_chunks(detokenizer, token_ids, rng)
        expected = tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
        assert "".join(deltas) == expected, token_ids


def test_valid_text_never_emits_a_partial_character(
    byte_level_tokenizer: PreTrainedTokenizerBase,
) -> None:
    tokenizer = byte_level_tokenizer
    rng = random.Random(7)
    for _ in range(100):
        words = rng.choices((*MULTI_BYTE_WORDS, "plain", " ", "."), k=rng.randint(1, 8))
        token_ids: list[int] = []
        for word in words:
            if rng.random() < 0.5:
                token_ids.extend(_byte_token_ids(tokenizer, word))
            else:
                token_ids.extend(tokenizer.encode(word, add_special_tokens=False))
        detokenizer = IncrementalDetokenizer(tokenizer)
        deltas = _detokenize_in_chunks(detokenizer, token_ids, rng)
        assert not any("\ufffd" in delta for delta in deltas), deltas
        assert "".join(deltas) == "".join(words)


def test_split_character_is_held_until_complete(bpe: PreTrainedTokenizerBase) -> None:
    detokenizer = IncrementalDetokenizer(bpe)
    emoji_bytes = _byte_token_ids(bpe, "😀")
    assert len(emoji_bytes) == 4
    assert [detokenizer.decode_next([t]) for t in emoji_bytes] == ["", "", "", "😀"]
    # A sequence that stops mid-character is released, as decode() shows it, by flush().
    assert detokenizer.decode_next(_byte_token_ids(bpe, "中")[:2]) == ""
    assert detokenizer.flush() == "\ufffd"
    assert detokenizer.flush() == ""


def test_skip_special_tokens(bpe: PreTrainedTokenizerBase) -> None:
    text = "<|im_start|>assistant\nhi <think>ok<|im_end|><|endoftext|>"
    token_ids = bpe.encode(text, add_special_tokens=False)
    skipping = IncrementalDetokenizer(bpe, skip_special_tokens=True)
    keeping = IncrementalDetokenizer(bpe, skip_special_tokens=False)
    rng = random.Random(0)
    # Non-special added tokens such as <think> stay, as in decode().
    assert "".join(_detokenize_in_chunks(skipping, token_ids, rng)) == "assistant\nhi <think>ok"
    assert "".join(_detokenize_in_chunks(keeping, token_ids, rng)) == text


def test_wordpiece_bert_tokenizer(bert: PreTrainedTokenizerBase) -> None:
    text = "Hello, world! Tokenization isn't trivial: 中文 café."
    token_ids = bert.encode(text)  # [CLS] ... [SEP]
    rng = random.Random(3)
    for skip_special_tokens in (True, False):
        detokenizer = IncrementalDetokenizer(bert, skip_special_tokens=skip_special_tokens)
        deltas = _detokenize_in_chunks(detokenizer, token_ids, rng)
        assert "".join(deltas) == bert.decode(token_ids, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas).startswith("[CLS] hello, world!")
    for _ in range(100):
        token_ids = [rng.randrange(len(bert)) for _ in range(rng.randint(1, 30))]
        for skip_special_tokens in (True, False):
            detokenizer = IncrementalDetokenizer(bert, skip_special_tokens=skip_special_tokens)
            deltas = _detokenize_in_chunks(detokenizer, token_ids, rng)
            expected = bert.decode(token_ids, skip_special_tokens=skip_special_tokens)
            assert "".join(deltas) == expected, token_ids


def test_spaces_between_special_tokens(bert: PreTrainedTokenizerBase) -> None:
    token_ids = [*bert.encode("hello world"), bert.pad_token_id]  # [CLS] hello world [SEP] [PAD]
    rng = random.Random(5)
    spaced = IncrementalDetokenizer(bert, skip_special_tokens=False)
    joined = IncrementalDetokenizer(
        bert, skip_special_tokens=False, spaces_between_special_tokens=False
    )
    assert "".join(_detokenize_in_chunks(spaced, token_ids, rng)) == (
        "[CLS] hello world [SEP] [PAD]"
    )
    assert "".join(_detokenize_in_chunks(joined, token_ids, rng)) == "[CLS]hello world[SEP][PAD]"
    skipped = IncrementalDetokenizer(bert, spaces_between_special_tokens=False)
    assert "".join(_detokenize_in_chunks(skipped, token_ids, rng)) == "hello world"


class _DecodeSpy:
    """Records the longest id list that detokenizers decode."""

    def __init__(self) -> None:
        self.max_ids_len = 0

    def plain_decoder(
        self, tokenizer: PreTrainedTokenizerBase, *, skip_special_tokens: bool
    ) -> Callable[[list[int]], str]:
        decode = plain_decoder(tokenizer, skip_special_tokens=skip_special_tokens)

        def spied_decode(token_ids: list[int]) -> str:
            self.max_ids_len = max(self.max_ids_len, len(token_ids))
            return decode(token_ids)

        return spied_decode


@pytest.fixture
def decode_spy(monkeypatch: pytest.MonkeyPatch) -> _DecodeSpy:
    # Spies on what the detokenizer decodes with: for a fast tokenizer that is the tokenizers
    # library's decode, which tokenizer.decode never sees.
    spy = _DecodeSpy()
    monkeypatch.setattr(detokenizer_module, "plain_decoder", spy.plain_decoder)
    return spy


def _assert_window_stays_bounded(
    tokenizer: PreTrainedTokenizerBase, decode_spy: _DecodeSpy, token_ids: list[int], stream: str
) -> None:
    assert len(token_ids) >= 500
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    deltas = [detokenizer.decode_next([token_id]) for token_id in token_ids]
    expected = tokenizer.decode(token_ids)
    if stream == "invalid_bytes":
        # Invalid bytes still stream: all but the last few are out before flush().
        assert len("".join(deltas)) >= len(expected) - 8
    deltas.append(detokenizer.flush())
    assert 0 < decode_spy.max_ids_len <= 16
    assert "".join(deltas) == expected


@pytest.mark.parametrize(
    "stream",
    ["valid_text", "invalid_bytes", "random_ids"],
)
def test_window_stays_bounded(
    bpe: PreTrainedTokenizerBase, decode_spy: _DecodeSpy, stream: str
) -> None:
    rng = random.Random(11)
    if stream == "valid_text":
        token_ids = [t for _ in range(300) for t in _byte_token_ids(bpe, rng.choice("é中😀a "))]
    elif stream == "invalid_bytes":
        # A lone UTF-8 continuation byte never completes, so the text always ends in U+FFFD.
        token_ids = _byte_token_ids(bpe, "é")[1:] * 500
    else:
        token_ids = [t for _ in range(100) for t in _random_token_ids(bpe, rng)]
    _assert_window_stays_bounded(bpe, decode_spy, token_ids, stream)


# ---------------------------------------------------------------- byte fallback


@pytest.fixture(scope="module")
def byte_fallback() -> PreTrainedTokenizerFast:
    """A SentencePiece-style BPE as Llama's and Mistral's: "▁" for spaces, and any character
    outside the vocabulary as <0xNN> byte tokens that the decoder's ByteFallback step joins
    back into UTF-8 (a run at a time), then Fuse, and Strip of the leading space."""
    backend = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=200,
        special_tokens=["<unk>", "<s>", "</s>"],
        # Few characters, so that accented letters, CJK and emoji fall back to bytes.
        limit_alphabet=30,
        show_progress=False,
    )
    corpus = ["the quick brown fox jumps over the lazy dog.", "hello world, hello there!"]
    backend.train_from_iterator(corpus * 20, trainer=trainer)
    spec = json.loads(backend.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    backend = Tokenizer.from_str(json.dumps(spec))
    backend.add_tokens(["<think>"])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


BYTE_FALLBACK_TEXTS = (
    "hello world, the lazy dog.",
    "café naïve über ÅÉÎ",
    "中文 汉字 中文文本",
    # A family emoji: three 4-byte emoji joined by 3-byte ZWJs, one run of 18 byte tokens.
    "😀 🚀🌍 the 👨\u200d👩\u200d👧 fox",
    "hello\nworld\n\n  two spaces\ttab",
    "   three leading spaces",
    "the<think>dog</s>fox <s> 中",
)


def _byte_fallback_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer.convert_tokens_to_ids([f"<0x{b:02X}>" for b in text.encode("utf-8")])


def test_deltas_concatenate_to_decode_byte_fallback(
    byte_fallback: PreTrainedTokenizerFast,
) -> None:
    # Characters split across byte tokens must never come out as U+FFFD, even when a step
    # brings several tokens and a run of byte tokens is longer than a character.
    tokenizer = byte_fallback
    byte_ids = set(tokenizer.convert_tokens_to_ids([f"<0x{b:02X}>" for b in range(256)]))
    # Not special tokens either, which skip_special_tokens would take out from between runs.
    other_ids = [
        t for t in range(len(tokenizer)) if t not in byte_ids and t not in tokenizer.all_special_ids
    ]
    rng = random.Random(17)
    sequences = [tokenizer.encode(text, add_special_tokens=False) for text in BYTE_FALLBACK_TEXTS]
    assert max(sum(t in byte_ids for t in ids) for ids in sequences) >= 18, "emoji as bytes"
    for _ in range(150):
        token_ids: list[int] = []
        for _ in range(rng.randint(1, 8)):
            # A token other than a byte ends the previous run (the test below has runs that
            # break after whole characters).
            token_ids.extend(rng.choice(other_ids) for _ in range(rng.randint(1, 3)))
            if rng.random() < 0.7:
                token_ids.extend(_byte_fallback_ids(tokenizer, rng.choice(MULTI_BYTE_WORDS)))
            else:
                # A run that is one broken character, maybe at the end of the sequence.
                character_bytes = _byte_fallback_ids(tokenizer, rng.choice("é中😀"))
                token_ids.extend(character_bytes[: rng.randint(1, len(character_bytes) - 1)])
        sequences.append(token_ids)
    for token_ids in sequences:
        for skip_special_tokens in (True, False):
            detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
            deltas = _detokenize_in_chunks(detokenizer, token_ids, rng)
            expected = tokenizer.decode(
                token_ids,
                skip_special_tokens=skip_special_tokens,
                clean_up_tokenization_spaces=False,
            )
            assert "".join(deltas) == expected, token_ids
            if "\ufffd" not in expected:
                assert not any("\ufffd" in delta for delta in deltas), deltas


def test_byte_run_broken_after_streaming_keeps_its_characters(
    byte_fallback: PreTrainedTokenizerFast,
) -> None:
    # decode() turns a whole run of byte tokens that is not valid UTF-8 into U+FFFD, whole
    # characters in it included; text already streamed stays as sent (as in vLLM), and the
    # rest of the run decodes on its own.
    tokenizer = byte_fallback
    token_ids = [
        *_byte_fallback_ids(tokenizer, "😀"),
        *_byte_fallback_ids(tokenizer, "é")[1:],  # a lone continuation byte breaks the run
        *tokenizer.encode(" hello", add_special_tokens=False),
    ]
    assert tokenizer.decode(token_ids) == "\ufffd" * 5 + " hello"
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.decode_next([token_id]) for token_id in token_ids]
    assert deltas[:4] == ["", "", "", "😀"]
    assert "".join(deltas) + detokenizer.flush() == "😀\ufffd hello"


def test_byte_fallback_stop_string_ends_at_its_last_byte(
    byte_fallback: PreTrainedTokenizerFast,
) -> None:
    # A newline is the byte token <0x0A> in such vocabularies, and "😀" four of them: a stop
    # string found only once a later token closed the run would cost a token more than vLLM.
    token_ids = byte_fallback.encode("hello\nworld 😀 fox", add_special_tokens=False)
    for stop, stop_token_index in [("\n", 1), ("😀", len(token_ids) - 2)]:
        request = RequestDetokenizer(byte_fallback, stop_strings=[stop])
        stopped_at = [request.update([t]) for t in token_ids[: stop_token_index + 1]]
        assert stopped_at == [None] * stop_token_index + [stop]


@pytest.mark.parametrize("stream", ["valid_text", "invalid_bytes"])
def test_window_stays_bounded_byte_fallback(
    byte_fallback: PreTrainedTokenizerFast, decode_spy: _DecodeSpy, stream: str
) -> None:
    # One run of byte tokens, however long, must not hold the window open.
    if stream == "valid_text":
        text = "".join(random.Random(12).choices(("é", "中", "😀", "👨\u200d👩"), k=200))
        token_ids = _byte_fallback_ids(byte_fallback, text)
    else:
        token_ids = _byte_fallback_ids(byte_fallback, "é")[1:] * 500
    _assert_window_stays_bounded(byte_fallback, decode_spy, token_ids, stream)


# ---------------------------------------------------------------- stop strings


def test_stop_at_the_very_end() -> None:
    matcher = StopStringMatcher(["<END>"])
    assert matcher.find("hello<END>", len("<END>")) == ("<END>", "hello")


def test_stop_in_the_middle_of_the_delta() -> None:
    matcher = StopStringMatcher(["<END>"])
    assert matcher.find("hello wor<END>ld and more", 20) == ("<END>", "hello wor")


def test_stop_spanning_two_deltas() -> None:
    matcher = StopStringMatcher(["<END>"])
    assert matcher.find("hello <EN", 3) == (None, "hello <EN")
    assert matcher.held_back_len_chars("hello <EN") == 3
    assert matcher.find("hello <END>!", 3) == ("<END>", "hello ")


def test_include_stop_str_in_output() -> None:
    matcher = StopStringMatcher(["<END>"], include_stop_str_in_output=True)
    assert matcher.find("hello <END>!", 3) == ("<END>", "hello <END>")
    assert matcher.held_back_len_chars("hello <EN") == 0


def test_earliest_stop_wins_then_shortest() -> None:
    matcher = StopStringMatcher(["world", "lo w", "lo", ""])
    assert matcher.find("hello world", len("hello world")) == ("lo", "hel")
    included = StopStringMatcher(["lo w", "lo"], include_stop_str_in_output=True)
    assert included.find("hello world", 11) == ("lo", "hello")


def test_only_the_tail_is_searched() -> None:
    matcher = StopStringMatcher(["STOP"])
    # An occurrence that ended before the new text was reported on an earlier call.
    assert matcher.find("STOP and then some", len(" some")) == (None, "STOP and then some")
    assert matcher.find("xxxSTO" + "P", 1) == ("STOP", "xxx")
    assert matcher.find("anything", 0) == (None, "anything")


def test_held_back_is_longest_stop_prefix() -> None:
    matcher = StopStringMatcher(["abcd", "cde", "x"])
    assert matcher.max_stop_len_chars == 4
    assert matcher.held_back_len_chars("zzabc") == 3
    assert matcher.held_back_len_chars("zzbb") == 0
    assert matcher.held_back_len_chars("zzbc") == 1  # "c" may start "cde"
    assert matcher.held_back_len_chars("zzcd") == 2
    assert matcher.held_back_len_chars("a") == 1
    assert matcher.held_back_len_chars("") == 0
    assert StopStringMatcher([]).held_back_len_chars("abc") == 0
    assert StopStringMatcher("abc").stop_strings == ("abc",)


# ---------------------------------------------------------------- per-request detokenizer


def _run_request(
    tokenizer: PreTrainedTokenizerBase,
    token_ids: list[int],
    rng: random.Random,
    **detokenizer_options: object,
) -> tuple[RequestDetokenizer, list[str]]:
    """Feed token ids in random chunks as an engine would; return the streamed deltas."""
    request = RequestDetokenizer(tokenizer, **detokenizer_options)  # type: ignore[arg-type]
    streamed: list[str] = []
    position = 0
    while position < len(token_ids) and not request.finished:
        chunk_len = rng.choice((1, 1, 2, 3))
        request.update(token_ids[position : position + chunk_len])
        position += chunk_len
        streamed.append(request.stream_delta())
    if not request.finished:
        request.finish()
    streamed.append(request.stream_delta())
    return request, streamed


def test_request_stops_at_stop_string(bpe: PreTrainedTokenizerBase) -> None:
    token_ids = bpe.encode("hello world. STOP more text", add_special_tokens=False)
    request, streamed = _run_request(bpe, token_ids, random.Random(0), stop_strings=["STOP"])
    assert request.matched_stop_string == "STOP"
    assert request.finished
    assert request.output_text == "hello world. "
    assert "".join(streamed) == "hello world. "
    with pytest.raises(RuntimeError):
        request.update([1])


def test_request_without_stop_finishes_and_releases_tail(bpe: PreTrainedTokenizerBase) -> None:
    token_ids = bpe.encode("hello wor", add_special_tokens=False)
    request = RequestDetokenizer(bpe, stop_strings=["world!"])
    for token_id in token_ids:
        assert request.update([token_id]) is None
    # "wor" could still become "world!", so it is held back from the stream.
    assert request.stream_delta() == "hello "
    assert request.output_text == "hello wor"
    assert request.stable_text == "hello "
    assert request.finish() is None
    assert request.stream_delta() == "wor"
    assert request.stable_text == "hello wor"
    assert request.matched_stop_string is None
    assert request.finish() is None


def test_request_finish_releases_broken_character(bpe: PreTrainedTokenizerBase) -> None:
    # The request ends mid-character: finish() shows the broken character, as decode() does.
    token_ids = bpe.encode("ok ", add_special_tokens=False) + _byte_token_ids(bpe, "中")[:2]
    request, streamed = _run_request(bpe, token_ids, random.Random(1), stop_strings=["zz"])
    assert request.output_text == "ok \ufffd"
    assert "".join(streamed) == "ok \ufffd"


STOP_ALPHABET = ("a", "b", " ", "é", "中", "😀", "ab", "a中", "<")
STOP_CANDIDATES = ("ab a", "中😀", "bb", "é<", "<", "a a a", "😀 é", "b中")


@pytest.mark.parametrize("include_stop_str_in_output", [False, True])
def test_streamed_text_never_leaks_a_stop_string(
    bpe: PreTrainedTokenizerBase, include_stop_str_in_output: bool
) -> None:
    rng = random.Random(99 + include_stop_str_in_output)
    matched = 0
    for _ in range(300):
        full_text = "".join(rng.choices(STOP_ALPHABET, k=rng.randint(1, 25)))
        stop_strings = rng.sample(STOP_CANDIDATES, k=rng.randint(1, 3))
        token_ids = bpe.encode(full_text, add_special_tokens=False)
        if rng.random() < 0.3:
            # Byte tokens split multi-byte characters across steps.
            token_ids = _byte_token_ids(bpe, full_text)
        request, streamed = _run_request(
            bpe,
            token_ids,
            rng,
            stop_strings=stop_strings,
            include_stop_str_in_output=include_stop_str_in_output,
        )
        output_text = request.output_text
        assert "".join(streamed) == output_text
        stop = request.matched_stop_string
        if stop is None:
            assert output_text == full_text
            assert not any(s in full_text for s in stop_strings)
            continue
        matched += 1
        text_through_stop = output_text if include_stop_str_in_output else output_text + stop
        assert full_text.startswith(text_through_stop)
        assert text_through_stop.endswith(stop)
        # No stop string was complete before this one ended.
        assert not any(s in text_through_stop[:-1] for s in stop_strings)
        if not include_stop_str_in_output:
            assert not any(s in delta for s in stop_strings for delta in streamed)
    assert matched > 50


def test_stop_strings_can_be_paused(bpe: PreTrainedTokenizerBase) -> None:
    # As before min_tokens: text goes out unmatched, but possible stop prefixes stay held back.
    request = RequestDetokenizer(bpe, stop_strings=["STOP"])
    for token_id in bpe.encode("a STOP b ST", add_special_tokens=False):
        assert request.update([token_id], check_stop_strings=False) is None
    assert request.output_text == "a STOP b ST"
    assert request.stream_delta() == "a STOP b "
    assert request.update(bpe.encode("OP c", add_special_tokens=False)) == "STOP"
    assert request.output_text == "a STOP b "
    assert request.stream_delta() == ""


def test_plain_decoder_equals_decode_and_honours_an_overridden_decode(
    bpe: PreTrainedTokenizerBase,
) -> None:
    """The fast path (the tokenizers library's decode, called directly) gives what the
    tokenizer's own decode gives; a tokenizer class that decodes its own way keeps its way."""
    ids = bpe("Hello wörld, <|endoftext|> again!")["input_ids"] + [bpe.eos_token_id]
    for skip in (True, False):
        want = bpe.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
        decode = plain_decoder(bpe, skip_special_tokens=skip)
        assert decode.func == bpe.backend_tokenizer.decode  # the fast path
        assert decode(ids) == want

    class Shouting(type(bpe)):  # type: ignore[misc]
        def _decode(self, token_ids, **kwargs) -> str:
            return super()._decode(token_ids, **kwargs).upper()

    shouting = Shouting(tokenizer_object=bpe.backend_tokenizer)
    decode = plain_decoder(shouting, skip_special_tokens=True)
    assert decode(ids) == bpe.decode(ids, skip_special_tokens=True).upper()


def test_text_at_finish_gives_the_incremental_text(bpe: PreTrainedTokenizerBase) -> None:
    ids = bpe("Héllo wörld, a 🤗 and\nmore")["input_ids"] + [bpe.eos_token_id]
    eager = RequestDetokenizer(bpe)
    deferred = RequestDetokenizer(bpe, text_at_finish=True)
    for token_id in ids:
        assert eager.update([token_id]) is None
        assert deferred.update([token_id]) is None
    assert deferred.output_text == "" and deferred.stream_delta() == ""  # nothing decoded yet
    eager.finish()
    deferred.finish()
    want = bpe.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert deferred.output_text == eager.output_text == want
    assert deferred.stream_delta() == want
    with pytest.raises(ValueError, match="stop strings"):
        RequestDetokenizer(bpe, stop_strings=["x"], text_at_finish=True)
