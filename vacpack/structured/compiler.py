"""Grammars compiled off the step loop, on a small thread pool, cached by (grammar, tokenizer).

A compiled grammar is an llguidance matcher in its start state; every sequence gets its own
copy (``deep_copy`` is cheap), so n samples or a thousand requests with one schema compile it
once. The first grammar also builds llguidance's view of the tokenizer (each token's bytes, a
trie over them): about 1 s per 30k tokens of vocabulary, once per engine.

Why llguidance rather than xgrammar, measured with `bench/grammar_engines.py` on this project's
2-core CPU while other jobs shared it (so roughly), with a 128k-token byte-level BPE: llguidance
compiles a JSON schema in 2-5 ms, xgrammar in 250-740 ms (xgrammar precomputes token masks per
grammar state, llguidance computes them lazily over a token trie), which matters for corpus jobs
where every request may carry its own schema. Filling 64 matchers' masks per step while they
walk a schema at random is comparable: xgrammar's median step is faster where its precomputed
states hit (about 1 ms against 7-15 ms), its slow steps are slower (90th percentile about 110 ms
against 30 ms). llguidance is one 3 MB wheel with no Python dependencies, and takes Lark and GBNF
grammars, regexes and choices directly.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import llguidance.hf
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from vacpack.structured.grammars import GrammarError, GrammarSpec

logger = logging.getLogger(__name__)

# Compiled grammars kept per engine; a schema used once more after this many others recompiles
# (cheap with llguidance) rather than holding every grammar ever seen.
GRAMMAR_CACHE_SIZE = 256
# Compilation is short and mostly in Rust (without the GIL); two workers keep one slow grammar
# from holding up the others without taking the cores the model runs on.
NUM_COMPILE_THREADS = 2


class GrammarCompiler:
    """Compiles grammars for one tokenizer and one model vocabulary size."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        eos_token_ids: Iterable[int],
    ) -> None:
        if not isinstance(tokenizer, PreTrainedTokenizerFast):
            raise ValueError(
                "structured outputs need a fast (Rust) tokenizer; "
                f"{type(tokenizer).__name__} is not one"
            )
        self.vocab_size = vocab_size
        self._hf_tokenizer = tokenizer
        self._eos_token_ids = sorted(eos_token_ids)
        self._pool = ThreadPoolExecutor(NUM_COMPILE_THREADS, thread_name_prefix="vacpack-grammar")
        self._lock = threading.Lock()
        self._tokenizer: Future[llguidance.LLTokenizer] | None = None
        self._compiled: OrderedDict[str, Future[llguidance.LLMatcher]] = OrderedDict()
        self.num_compiled = 0  # cache misses, for tests and reports

    def compile(self, spec: GrammarSpec) -> Future[llguidance.LLMatcher]:
        """A future start-state matcher for the grammar; never blocks the caller."""
        with self._lock:
            future = self._compiled.get(spec.text)
            if future is not None:
                self._compiled.move_to_end(spec.text)
                return future
            future = self._pool.submit(self._compile, spec)
            self._compiled[spec.text] = future
            self.num_compiled += 1
            if len(self._compiled) > GRAMMAR_CACHE_SIZE:
                self._compiled.popitem(last=False)
            return future

    def _build_tokenizer(self) -> llguidance.LLTokenizer:
        return llguidance.hf.from_tokenizer(
            self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos_token_ids or None
        )

    def _compile(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        tokenizer = self._llguidance_tokenizer()
        matcher = llguidance.LLMatcher(tokenizer, spec.text, log_level=0)
        if matcher.is_error():
            problem = matcher.get_error()
            raise GrammarError(f"{spec.description} cannot constrain generation: {problem}")
        return matcher

    def _llguidance_tokenizer(self) -> llguidance.LLTokenizer:
        # Built by the first compile task that needs it; the others wait for that one.
        with self._lock:
            if self._tokenizer is None:
                future: Future[llguidance.LLTokenizer] = Future()
                self._tokenizer = future
                owner = True
            else:
                future = self._tokenizer
                owner = False
        if owner:
            try:
                future.set_result(self._build_tokenizer())
            except BaseException as error:
                future.set_exception(error)
        return future.result()
