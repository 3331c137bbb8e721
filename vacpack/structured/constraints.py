"""One sequence's token constraints: its grammar matcher, allowed and banned tokens, biases.

The matcher advances only on tokens the host has read and kept, so it never needs rolling back
in this engine: a token sampled by a step that was already launched for a sequence that has
finished since is dropped before it reaches the matcher, and a preempted sequence keeps its
output tokens (its KV cache is recomputed; its matcher state stays right).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Literal

import llguidance
import numpy as np

from vacpack.structured.token_masks import bitmask_num_words

logger = logging.getLogger(__name__)

# What a token read by the host does to a constrained output.
Advance = Literal["continue", "complete", "refused"]


class SequenceConstraints:
    def __init__(
        self,
        grammar: Future[llguidance.LLMatcher] | None,
        static_mask: np.ndarray | None,
        bad_word_sequences: Sequence[tuple[tuple[int, ...], int]],
        logit_bias: Mapping[int, float] | None,
    ) -> None:
        self._grammar = grammar
        self.matcher: llguidance.LLMatcher | None = None
        # int32 words of the allowed tokens (allowed_token_ids, minus one-token bad words).
        self.static_mask = static_mask
        # (the tokens before, the banned last token) for bad words of more than one token.
        self.bad_word_sequences = list(bad_word_sequences)
        self.logit_bias = logit_bias
        self.error: BaseException | None = None  # why the grammar could not be compiled

    @property
    def has_grammar(self) -> bool:
        return self._grammar is not None

    @property
    def is_ready(self) -> bool:
        """False while the grammar is still being compiled."""
        return self._grammar is None or self._grammar.done()

    def start(self) -> None:
        """Takes the sequence's own copy of the compiled grammar (once ready). A grammar that
        failed to compile leaves every token allowed, and the first token read ends the output
        (see accept)."""
        if self._grammar is None or self.matcher is not None or self.error is not None:
            return
        try:
            self.matcher = self._grammar.result().deep_copy()
        except Exception as error:  # the compile task's error, whatever its type
            self.error = error

    @property
    def needs_mask(self) -> bool:
        return self.has_grammar or self.static_mask is not None or bool(self.bad_word_sequences)

    @property
    def needs_known_outputs(self) -> bool:
        """True when the next mask depends on the latest output token."""
        return self.has_grammar or bool(self.bad_word_sequences)

    def finish_row(self, row: np.ndarray, output_token_ids: Sequence[int]) -> None:
        """Narrows a row the grammar filled (or all ones) by the token lists; in place."""
        grammar_row = row.copy() if self.static_mask is not None and self.has_grammar else None
        if self.static_mask is not None:
            row &= self.static_mask
            if grammar_row is not None and not row.any():
                # allowed_token_ids left nothing the grammar accepts: the grammar wins, since
                # a token outside it would end the document.
                row[:] = grammar_row
        if not self.bad_word_sequences:
            return
        row_bytes = row.view(np.uint8)  # little-endian words: token t is bit t % 8 of byte t // 8
        for prefix, banned in self.bad_word_sequences:
            num_before = len(prefix)
            if num_before <= len(output_token_ids) and (
                tuple(output_token_ids[len(output_token_ids) - num_before :]) == prefix
            ):
                row_bytes[banned >> 3] &= ~np.uint8(1 << (banned & 7))

    def accept(self, token_id: int) -> bool:
        """Advances the matcher past a sampled token; False when the grammar refuses it."""
        if self.error is not None:
            return False
        return self.matcher is None or self.matcher.consume_token(token_id)

    def problem(self, token_id: int) -> str:
        """Why accept(token_id) returned False."""
        if self.error is not None:
            return f"the grammar could not be compiled: {self.error}"
        assert self.matcher is not None
        return f"the grammar refused token {token_id}: {self.matcher.get_error()}"

    def advance(self, token_id: int) -> Advance:
        """Takes a token the host has read: "complete" when the grammar allows nothing more
        after it, "refused" when the grammar refuses it (or could not be compiled)."""
        if not self.has_grammar:
            return "continue"
        if not self.accept(token_id):
            logger.error("constrained output stopped: %s", self.problem(token_id))
            return "refused"
        return "complete" if self.is_complete else "continue"

    @property
    def is_complete(self) -> bool:
        """True when the grammar allows nothing more: the output is done."""
        return self.matcher is not None and self.matcher.is_stopped()


def allowed_tokens_mask(
    vocab_size: int, allowed_token_ids: Sequence[int] | None, banned_token_ids: Sequence[int]
) -> np.ndarray | None:
    """int32 words allowing allowed_token_ids (or every token) except banned_token_ids."""
    if allowed_token_ids is None and not banned_token_ids:
        return None
    bits = np.zeros(bitmask_num_words(vocab_size) * 32, dtype=np.uint8)
    if allowed_token_ids is None:
        bits[:vocab_size] = 1
    else:
        bits[list(allowed_token_ids)] = 1
    bits[list(banned_token_ids)] = 0
    return np.packbits(bits, bitorder="little").view(np.int32).copy()
