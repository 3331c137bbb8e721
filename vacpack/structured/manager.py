"""What the engine calls for constrained requests, in five places:

1. ``check`` + ``constraints_for`` when a request is added: a bad schema or token id raises
   ValueError before any work; the grammar starts compiling on the pool, and the scheduler
   leaves the request waiting (others run) until ``constraints.is_ready``;
2. ``step_masks`` when a step is prepared: the bitmask of its sampled rows, filled at once when
   every token it depends on is known, else left for
3. ``fill`` right after the host has read the previous step's tokens (async scheduling: the
   device runs the step's forward meanwhile and waits for the masks only to sample);
4. ``SequenceConstraints.advance`` for every token the host reads (in the scheduler's
   update_from_output): the matcher advances, and says whether the output is complete
   (finish "stop") or the token was refused (finish "abort");
5. ``wait_for_grammars`` when nothing can run until a grammar is compiled.

Step N+1's masks need step N's tokens. Where the device work runs on a worker thread (CPU,
async scheduling) the step is launched with its masks unfilled and waits for them after its
forward, so filling them overlaps the forward (vLLM splits its step the same way, SGLang's
overlap scheduler waits in its forward thread). Where the host itself queues the device work
(CUDA streams) a step with constrained rows reads the previous step first, as penalties do;
splitting the CUDA launch into forward and sampling would lift that.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Protocol

import llguidance
import llguidance.numpy
import torch
from transformers import PreTrainedTokenizerBase

from vacpack.errors import RequestFieldError
from vacpack.sampling import SamplingParams
from vacpack.structured.compiler import GRAMMAR_CACHE_SIZE, GrammarCompiler
from vacpack.structured.constraints import SequenceConstraints, allowed_tokens_mask
from vacpack.structured.grammars import GrammarSpec, grammar_spec
from vacpack.structured.token_masks import LogitBias, StepTokenMasks

logger = logging.getLogger(__name__)


class ConstrainedSequence(Protocol):
    """What the manager reads of an engine sequence."""

    constraints: SequenceConstraints | None

    @property
    def output_token_ids(self) -> list[int]: ...

    @property
    def is_finished(self) -> bool: ...

    @property
    def num_pending_tokens(self) -> int: ...


class StructuredOutputManager:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        device: torch.device,
    ) -> None:
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._eos_token_ids = frozenset(eos_token_ids)
        self._pin = device.type == "cuda"
        # Built on the first constrained request: an engine that never sees one pays nothing.
        self._compiler: GrammarCompiler | None = None
        # Checked grammars by constraint: a schema sent with every request is checked once,
        # not on the engine thread per request.
        self._specs: OrderedDict[tuple[str, str], GrammarSpec] = OrderedDict()
        self._compiling: set[concurrent.futures.Future[llguidance.LLMatcher]] = set()

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            self._compiler = GrammarCompiler(self._tokenizer, self.vocab_size, self._eos_token_ids)
        return self._compiler

    # ---------------------------------------------------------------- requests in
    def check(self, params: SamplingParams) -> GrammarSpec | None:
        """The request's grammar, checked; ValueError naming what is wrong with its controls."""
        for field_name, token_ids in (
            ("logit_bias", params.logit_bias or ()),
            ("allowed_token_ids", params.allowed_token_ids or ()),
        ):
            bad = [t for t in token_ids if t >= self.vocab_size]
            if bad:
                raise RequestFieldError(
                    field_name,
                    f"{field_name} names token ids outside the vocabulary [0, {self.vocab_size}): "
                    f"{bad[:5]}",
                )
        structured = params.structured_outputs
        if structured is None:
            return None
        value = getattr(structured, structured.kind)
        key = (structured.kind, json.dumps(value, sort_keys=True, default=list))
        spec = self._specs.get(key)
        if spec is None:
            spec = grammar_spec(structured)
            self._specs[key] = spec
            if len(self._specs) > GRAMMAR_CACHE_SIZE:
                self._specs.popitem(last=False)
        self._specs.move_to_end(key)
        return spec

    def constraints_for(
        self, params: SamplingParams, spec: GrammarSpec | None
    ) -> SequenceConstraints | None:
        """A new sequence's constraints (one per sample: each has its own matcher)."""
        if not params.constrains_tokens:
            return None
        grammar = None
        if spec is not None:
            grammar = self.compiler.compile(spec)
            if not grammar.done():
                self._compiling.add(grammar)
        single_token_words, word_sequences = self._bad_word_token_ids(params.bad_words or ())
        static_mask = allowed_tokens_mask(
            self.vocab_size, params.allowed_token_ids, single_token_words
        )
        return SequenceConstraints(grammar, static_mask, word_sequences, params.logit_bias)

    def _bad_word_token_ids(
        self, bad_words: Sequence[str]
    ) -> tuple[list[int], list[tuple[tuple[int, ...], int]]]:
        """(tokens banned outright, (tokens before, last token) of longer words), as vLLM does:
        each word with and without a leading space, so it is caught mid-text too."""
        single: set[int] = set()
        sequences: set[tuple[tuple[int, ...], int]] = set()
        for word in bad_words:
            for text in (word.lstrip(), " " + word.lstrip()):
                token_ids = self._tokenizer.encode(text, add_special_tokens=False)
                if len(token_ids) == 1:
                    single.add(token_ids[0])
                elif token_ids:
                    sequences.add((tuple(token_ids[:-1]), token_ids[-1]))
        return sorted(single), sorted(sequences)

    def wait_for_grammars(self, timeout_s: float) -> None:
        """Blocks until a grammar being compiled is ready (or timeout_s passes)."""
        self._compiling = {f for f in self._compiling if not f.done()}
        if self._compiling:
            concurrent.futures.wait(
                self._compiling, timeout_s, return_when=concurrent.futures.FIRST_COMPLETED
            )

    # ---------------------------------------------------------------- steps
    def step_masks(self, sequences: Sequence[ConstrainedSequence]) -> StepTokenMasks | None:
        """The token masks of a step's sampled rows (None when no row has a constraint).

        Filled now when every constrained row's latest token is known; otherwise ``fill``
        must be called once it is (the device waits for it before sampling)."""
        masked_rows: list[int] = []
        bias = LogitBias([], [], [])
        must_wait = False
        for row, sequence in enumerate(sequences):
            constraints = sequence.constraints
            if constraints is None:
                continue
            constraints.start()
            if constraints.needs_mask:
                masked_rows.append(row)
                must_wait |= constraints.needs_known_outputs and sequence.num_pending_tokens > 0
            for token_id, value in (constraints.logit_bias or {}).items():
                bias.rows.append(row)
                bias.token_ids.append(token_id)
                bias.values.append(value)
        if not masked_rows and not bias.rows:
            return None
        masks = StepTokenMasks(
            len(sequences), self.vocab_size, masked_rows, bias if bias.rows else None, self._pin
        )
        if not must_wait:
            self.fill(masks, sequences)
        return masks

    def fill(self, masks: StepTokenMasks, sequences: Sequence[ConstrainedSequence]) -> None:
        """Fills the masks from the sequences' current state (once; later calls do nothing)."""
        if masks.is_filled:
            return
        fill_start_s = time.perf_counter()
        try:
            if masks.bitmask is not None:
                self._fill_bitmask(masks.bitmask, masks.masked_rows, sequences)
        finally:
            # Set even on an error, so that a device step waiting for the masks goes on.
            masks.mark_filled(fill_start_s)

    def _fill_bitmask(
        self,
        bitmask: torch.Tensor,
        masked_rows: list[int],
        sequences: Sequence[ConstrainedSequence],
    ) -> None:
        rows = bitmask.numpy()  # the same memory
        # One row after another: llguidance's thread-pool fill measured 3-15x slower than this
        # on a 2-core CPU (64 rows of a 128k vocabulary: 1.5 ms per step serially).
        for row in masked_rows:
            sequence = sequences[row]
            constraints = sequence.constraints
            assert constraints is not None
            if sequence.is_finished:
                continue  # its row is dropped: all ones is as good as anything
            if constraints.matcher is not None:
                llguidance.numpy.fill_next_token_bitmask(constraints.matcher, rows, row)
            constraints.finish_row(rows[row], sequence.output_token_ids)
