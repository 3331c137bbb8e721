"""Text out of the engine: streaming detokenization and stop strings, per request.

`RequestDetokenizer` turns each step's new token ids into text with an `IncrementalDetokenizer`
(a bounded window of ids, so a step costs the same at token 10 as at token 10,000) and cuts that
text at stop strings with a `StopStringMatcher`, holding back any tail that could still grow into
a stop string so that streamed text never has to be taken back.
"""

from __future__ import annotations

import codecs
import json
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from vacpack.tokenizer import decode_text, plain_decoder

# What UTF-8 decoding yields for bytes that do not (yet) form a character.
REPLACEMENT_CHAR = "\ufffd"


@dataclass(frozen=True)
class _DecodeFacts:
    """What the detokenizer needs to know about a tokenizer's added (special) tokens."""

    # Ids that decode(..., skip_special_tokens=True) drops. Worked out by asking decode itself,
    # because fast tokenizers skip every added token marked special while
    # convert_ids_to_tokens only skips the named ones (eos, pad, ...).
    skipped_token_ids: frozenset[int]
    added_token_text: Mapping[int, str]
    # The <0xNN> tokens of a SentencePiece-style vocabulary whose decoder has a ByteFallback
    # step, and their bytes; empty for any other decoder. IncrementalDetokenizer says why.
    token_bytes: Mapping[int, int]


_decode_facts_cache: weakref.WeakKeyDictionary[PreTrainedTokenizerBase, _DecodeFacts] = (
    weakref.WeakKeyDictionary()
)


def _decode_facts(tokenizer: PreTrainedTokenizerBase) -> _DecodeFacts:
    # Cached per tokenizer: a vocabulary can have hundreds of added tokens and a detokenizer is
    # made for every request.
    facts = _decode_facts_cache.get(tokenizer)
    if facts is None:
        added_tokens = tokenizer.added_tokens_decoder
        candidate_ids = set(added_tokens) | set(tokenizer.all_special_ids)
        skipped_token_ids = frozenset(
            token_id
            for token_id in candidate_ids
            if tokenizer.decode([token_id], skip_special_tokens=True) == ""
        )
        added_token_text = {token_id: token.content for token_id, token in added_tokens.items()}
        facts = _DecodeFacts(skipped_token_ids, added_token_text, _token_bytes(tokenizer))
        _decode_facts_cache[tokenizer] = facts
    return facts


def _token_bytes(tokenizer: PreTrainedTokenizerBase) -> dict[int, int]:
    """Id -> byte of the <0xNN> tokens that the tokenizer's ByteFallback decoder turns into
    bytes; empty without one."""
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        return {}
    backend = tokenizer.backend_tokenizer
    decoder = backend.decoder
    # The decoder's own JSON, not the whole tokenizer's: to_str() would serialize the vocabulary.
    if decoder is None or not _has_byte_fallback(json.loads(decoder.__getstate__())):
        return {}
    token_bytes: dict[int, int] = {}
    for byte in range(256):
        for name in (f"<0x{byte:02X}>", f"<0x{byte:02x}>"):  # ByteFallback reads either case
            token_id = backend.token_to_id(name)
            if token_id is not None:
                token_bytes[token_id] = byte
    return token_bytes


def _has_byte_fallback(decoder: Any) -> bool:
    """Whether a decoder's JSON (a Sequence of decoders, or one) has a ByteFallback step."""
    if isinstance(decoder, dict):
        if decoder.get("type") == "ByteFallback":
            return True
        decoder = list(decoder.values())
    return isinstance(decoder, list) and any(_has_byte_fallback(part) for part in decoder)


# The context grows over a few steps before it is cut back to the last emitted chunk, which
# saves decoding the new context on most steps.
_MAX_CONTEXT_TOKENS = 8
# A step that leaves this many ids undecided (text still ending in U+FFFD) looks for an earlier
# split instead of waiting, so that a run of invalid bytes cannot grow the window without bound.
_MAX_UNDECIDED_TOKENS = 4
# A UTF-8 character has at most 4 bytes and every token at least one, so whatever character
# straddles a split has been completed or broken for good once 3 more tokens follow it.
_TOKENS_THAT_SETTLE_A_CHARACTER = 3
# How many earlier splits to try before giving up until the next step.
_MAX_SPLITS_TRIED = 4


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas, one step at a time.

    Each step decodes a small window: a few recently emitted ids (context, so that decoders
    that join or strip by position, such as WordPiece's "##" or SentencePiece's "▁", see a
    neighbour) followed by the ids not yet emitted, and emits the text beyond the context's.
    Text that ends in U+FFFD is held back, since the next token may complete the character.
    Both ends of the context lie where the decoded text ended in a whole character, so the
    window decodes exactly as the same ids do inside the full sequence.

    The deltas from decode_next() followed by flush() concatenate to
    tokenizer.decode(all_ids, skip_special_tokens=...) (with clean_up_tokenization_spaces off,
    whose rewrites need look-ahead) for byte-level BPE, WordPiece and SentencePiece-style
    (Metaspace, byte fallback) tokenizers, with one exception below.
    spaces_between_special_tokens=False instead joins added tokens to their neighbours with
    no separator, as vLLM does; True leaves spacing to the tokenizer's own decoder.

    A ByteFallback decoder (Llama, Mistral) decodes each run of consecutive <0xNN> tokens as a
    whole, and a run that is not valid UTF-8 becomes one U+FFFD per byte, its whole characters
    included. So no split may fall inside a run whose text is undecided (it is U+FFFD on both
    sides wherever it is cut). A character is still emitted as soon as its last byte arrives,
    as vLLM does (a newline is a byte token there, and a stop string must not wait for the
    next token): the exception is a run that breaks after that, which keeps the characters
    already emitted where decode() would show U+FFFD for them.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._spaces_between_special_tokens = spaces_between_special_tokens
        self._facts = _decode_facts(tokenizer)
        self._plain_decode = plain_decoder(tokenizer, skip_special_tokens=skip_special_tokens)
        # Skipped ids never enter the window: decode() drops them anyway, and leaving them out
        # keeps a run of them from pushing the real context out of the window.
        self._dropped_token_ids = self._facts.skipped_token_ids if skip_special_tokens else None
        self._token_bytes = self._facts.token_bytes
        self._window_token_ids: list[int] = []
        # window[:_read_offset] is context whose text has been emitted; the rest is undecided.
        self._read_offset = 0
        self._context_text = ""

    def decode_next(self, new_token_ids: Iterable[int]) -> str:
        """Take this step's new token ids; return the text that is now final (maybe "")."""
        new_ids = [int(token_id) for token_id in new_token_ids]
        if self._dropped_token_ids:
            new_ids = [token_id for token_id in new_ids if token_id not in self._dropped_token_ids]
        if not new_ids:
            return ""
        self._window_token_ids.extend(new_ids)
        window_text = self._decode(self._window_token_ids)
        if not window_text.endswith(REPLACEMENT_CHAR):
            return self._emit_through(len(self._window_token_ids), window_text)
        undecided_tokens = len(self._window_token_ids) - self._read_offset
        if undecided_tokens >= _MAX_UNDECIDED_TOKENS:
            return self._emit_through_earlier_split(window_text)
        return ""

    def flush(self) -> str:
        """Release everything held back (the request is over), incomplete characters included."""
        if self._read_offset == len(self._window_token_ids):
            return ""
        window_text = self._decode(self._window_token_ids)
        return self._emit_through(len(self._window_token_ids), window_text)

    def _emit_through(self, split: int, text_through_split: str) -> str:
        """Emit the text of window[:split] beyond the context; nothing before split can change."""
        if text_through_split.startswith(self._context_text):
            delta = text_through_split[len(self._context_text) :]
        else:
            # The context ends inside a run of byte tokens that has since broken, turning its
            # emitted characters into U+FFFD. They stay as emitted; the bytes after them decode
            # on their own (still broken: the emitted part was whole characters).
            delta = self._decode(self._window_token_ids[self._read_offset : split])
        if split <= _MAX_CONTEXT_TOKENS:
            # All of window[:split] becomes the context, and its text is already in hand.
            self._read_offset = split
            self._context_text = text_through_split
        else:
            # Restart the context at the previous split, which also ended a whole character,
            # so the chunk decodes on its own exactly as it did inside the window (the rest of
            # a run of byte tokens too: after whole characters, it is valid alone if whole).
            del self._window_token_ids[: self._read_offset]
            self._read_offset = split - self._read_offset
            self._context_text = self._decode(self._window_token_ids[: self._read_offset])
        return delta

    def _emit_through_earlier_split(self, window_text: str) -> str:
        # A trailing U+FFFD that has lasted this long is usually a genuinely invalid byte, so
        # look for an earlier split whose text is settled. Far enough back, any character
        # straddling the split has been decided; and the two sides decoding separately to the
        # same text shows the split does not cut through a character, nor through the bytes of
        # one invalid sequence (which decode to a single U+FFFD together, but one each apart).
        latest_split = len(self._window_token_ids) - _TOKENS_THAT_SETTLE_A_CHARACTER
        earliest_split = max(self._read_offset + 1, latest_split - _MAX_SPLITS_TRIED + 1)
        for split in range(latest_split, earliest_split - 1, -1):
            if self._cuts_an_unsettled_byte_run(split):
                # Whatever the check below says: an unfinished character is one U+FFFD per byte
                # however it is split, and the next byte can still make it whole.
                continue
            text_through_split = self._decode(self._window_token_ids[:split])
            if not window_text.startswith(text_through_split):
                continue
            text_after_split = self._decode(self._window_token_ids[split:])
            if text_after_split and text_through_split + text_after_split == window_text:
                return self._emit_through(split, text_through_split)
        return ""

    def _cuts_an_unsettled_byte_run(self, split: int) -> bool:
        """Whether split falls inside a run of byte tokens that may yet decode to characters.

        Not when the bytes on each side of it are invalid UTF-8 whatever follows: every byte of
        the run is then U+FFFD for good, on both sides of any later cut of the window there
        too. Such splits keep a long run of invalid bytes from growing the window unbounded.
        """
        window = self._window_token_ids
        token_bytes = self._token_bytes
        if window[split - 1] not in token_bytes or window[split] not in token_bytes:
            return False
        run_start = split - 1
        while run_start > 0 and window[run_start - 1] in token_bytes:
            run_start -= 1
        run_end = split + 1
        while run_end < len(window) and window[run_end] in token_bytes:
            run_end += 1
        return not (
            _invalid_for_good(bytes(token_bytes[t] for t in window[run_start:split]))
            and _invalid_for_good(bytes(token_bytes[t] for t in window[split:run_end]))
        )

    def _decode(self, token_ids: list[int]) -> str:
        if self._spaces_between_special_tokens or not self._facts.added_token_text:
            return self._decode_plain(token_ids)
        # Added tokens are written out verbatim and the runs between them decoded on their own,
        # so the decoder cannot put spaces around the added tokens.
        pieces: list[str] = []
        run_start = 0
        for position, token_id in enumerate(token_ids):
            added_text = self._facts.added_token_text.get(token_id)
            if added_text is not None:
                if run_start < position:
                    pieces.append(self._decode_plain(token_ids[run_start:position]))
                pieces.append(added_text)
                run_start = position + 1
        if run_start < len(token_ids):
            pieces.append(self._decode_plain(token_ids[run_start:]))
        return "".join(pieces)

    def _decode_plain(self, token_ids: list[int]) -> str:
        return self._plain_decode(token_ids)


def _invalid_for_good(data: bytes) -> bool:
    """Whether data is not valid UTF-8 and no bytes after it can make it so."""
    try:
        codecs.getincrementaldecoder("utf-8")().decode(data, final=False)
    except UnicodeDecodeError:
        return True
    return False


class StopStringMatcher:
    """Finds stop strings in output text as it grows, looking only where a new match can be.

    Each call sees the whole text so far and how much of it is new. A match must end in the new
    text (anything earlier was checked on an earlier call), so only the last
    len(new text) + max_stop_len_chars - 1 characters are searched.
    """

    def __init__(
        self, stop_strings: Iterable[str], *, include_stop_str_in_output: bool = False
    ) -> None:
        if isinstance(stop_strings, str):
            stop_strings = (stop_strings,)  # one stop string, not one per character
        # An empty stop string would match everywhere; duplicates would only cost time.
        self.stop_strings: tuple[str, ...] = tuple(dict.fromkeys(s for s in stop_strings if s))
        self.include_stop_str_in_output = include_stop_str_in_output
        self.max_stop_len_chars = max((len(s) for s in self.stop_strings), default=0)

    def find(self, text: str, new_text_len_chars: int) -> tuple[str | None, str]:
        """Return (stop string, text cut at it), or (None, text) when nothing matched.

        Of the stop strings that end in the last new_text_len_chars characters, the one that
        starts earliest wins (the shortest on a tie). The text is cut before it, or after it
        when include_stop_str_in_output.
        """
        if new_text_len_chars <= 0 or not self.stop_strings:
            return None, text
        new_text_start = len(text) - new_text_len_chars
        matched_stop: str | None = None
        matched_start = len(text)
        for stop in self.stop_strings:
            # Starting here, any occurrence found ends inside the new text.
            search_start = max(0, new_text_start - len(stop) + 1)
            start = text.find(stop, search_start)
            if start == -1:
                continue
            if matched_stop is None or (start, len(stop)) < (matched_start, len(matched_stop)):
                matched_stop, matched_start = stop, start
        if matched_stop is None:
            return None, text
        cut = matched_start + (len(matched_stop) if self.include_stop_str_in_output else 0)
        return matched_stop, text[:cut]

    def held_back_len_chars(self, text: str) -> int:
        """How many trailing characters of text must not be streamed yet.

        They are the longest tail of text that is the start of some stop string: if the stop
        string completes, that tail will be cut away. At most max_stop_len_chars - 1. When the
        stop string is kept in the output nothing needs holding back: a stop string completed
        later ends after all of the current text, so the cut never falls in streamed text.
        """
        if self.include_stop_str_in_output:
            return 0
        held_back = 0
        for stop in self.stop_strings:
            for prefix_len in range(min(len(stop) - 1, len(text)), held_back, -1):
                if text.endswith(stop[:prefix_len]):
                    held_back = prefix_len
                    break
        return held_back


class RequestDetokenizer:
    """Output text of one request: incremental detokenization, stop strings and streaming.

    The engine calls update() with each step's new token ids, reads stream_delta() (or
    stable_text) for text that is safe to send now, and calls finish() when the request ends
    for any reason other than a stop string (eos, length, abort) to release what was held
    back. output_text is the text so far, and the final text once the request has finished.

    text_at_finish=True (no stop strings allowed) decodes nothing until finish(), then all of
    the ids at once, to the same text: for a request whose text nobody reads before it ends
    (an offline batch's outputs), which saves the host a decode per token, about 10 us per
    sequence and step.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        stop_strings: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        text_at_finish: bool = False,
    ) -> None:
        if text_at_finish and stop_strings:
            raise ValueError("stop strings are matched as the text grows: not text_at_finish")
        self._tokenizer = tokenizer
        # Ids not decoded yet; None: decoded as they come.
        self._deferred_token_ids: list[int] | None = [] if text_at_finish else None
        self._detokenizer = IncrementalDetokenizer(
            tokenizer,
            skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=spaces_between_special_tokens,
        )
        self._stop_matcher = StopStringMatcher(
            stop_strings, include_stop_str_in_output=include_stop_str_in_output
        )
        self._output_text = ""
        self._streamed_len_chars = 0
        self._held_back_len_chars = 0
        self.matched_stop_string: str | None = None
        self.finished = False

    @property
    def output_text(self) -> str:
        return self._output_text

    @property
    def stable_text(self) -> str:
        """output_text less the tail that a stop string could still cut (all of it once
        finished): what a cumulative output shows, so that its text only ever grows."""
        return self._output_text[: len(self._output_text) - self._held_back_len_chars]

    def token_text(self, token_id: int) -> str:
        """One token's own text, decoded alone (a logprob's `decoded_token`)."""
        return decode_text(self._tokenizer, [token_id])

    def update(
        self, new_token_ids: Iterable[int], *, check_stop_strings: bool = True
    ) -> str | None:
        """Add this step's token ids; return the stop string that ended the request, if any.

        After a stop string matches, the request is finished and output_text is final.
        check_stop_strings=False (e.g. before min_tokens) appends the text without matching;
        a stop string is then found only if it ends in text added once checking is back on.
        """
        if self.finished:
            raise RuntimeError("update() called on a request whose output has finished")
        if self._deferred_token_ids is not None:
            self._deferred_token_ids.extend(new_token_ids)
            return None
        delta = self._detokenizer.decode_next(new_token_ids)
        return self._append(delta, check_stop_strings=check_stop_strings)

    def finish(self) -> str | None:
        """End the request: flush incomplete characters and stop holding text back.

        Returns the stop string if the flushed text completed one (output_text is then cut
        there as usual), else None. Calling it again does nothing.
        """
        if self.finished:
            return None
        if self._deferred_token_ids:
            text = self._detokenizer.decode_next(self._deferred_token_ids)
            self._append(text, check_stop_strings=False)
            self._deferred_token_ids.clear()
        matched_stop = self._append(self._detokenizer.flush(), check_stop_strings=True)
        self._finish()
        return matched_stop

    def stream_delta(self) -> str:
        """Text not yet streamed that can no longer change; "" when there is none."""
        safe_end = max(self._streamed_len_chars, len(self._output_text) - self._held_back_len_chars)
        delta = self._output_text[self._streamed_len_chars : safe_end]
        self._streamed_len_chars = safe_end
        return delta

    def _append(self, delta: str, *, check_stop_strings: bool) -> str | None:
        if not delta:
            return None
        matched_stop: str | None = None
        self._output_text += delta
        if check_stop_strings:
            matched_stop, self._output_text = self._stop_matcher.find(self._output_text, len(delta))
        if matched_stop is not None:
            self.matched_stop_string = matched_stop
            self._finish()
            return matched_stop
        self._held_back_len_chars = self._stop_matcher.held_back_len_chars(self._output_text)
        return None

    def _finish(self) -> None:
        self.finished = True
        self._held_back_len_chars = 0
