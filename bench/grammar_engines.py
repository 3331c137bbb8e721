"""llguidance against xgrammar on this CPU: grammar compile time and token-mask time.

What chose vacpack's grammar engine (vacpack/structured/compiler.py). Both engines get the same
tokenizer of realistic size (the 128,000-token byte-level BPE that bench/structured.py trains
on this Python installation's sources, or `--tokenizer DIR`), the same JSON schema, a regex,
a small EBNF grammar and json_object; then 64 matchers walk the schema's documents together,
each step taking a random allowed token per matcher (a babbling model), and the time to fill
the batch's masks is recorded per step: serially, and with each engine's own thread pool.

    python bench/grammar_engines.py [--tokenizer DIR] [--output FILE.json]

Needs xgrammar (the `bench` extra); llguidance is a vacpack dependency.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import harness
import numpy as np
from structured import INVOICE_SCHEMA, python_bpe_tokenizer

NUM_MATCHERS = 64
NUM_STEPS = 100
REGEX = r"[A-Z][a-z]{2,8}-[0-9]{3}"
GBNF = 'root ::= "(" expr ")"\nexpr ::= term (("+" | "-") term)*\nterm ::= [0-9]+'
JSON_LAYOUT = (", ", ": ")


def log(message: str) -> None:
    harness.log(message, "grammar-engines")


def _timed(work: Callable[[], Any]) -> tuple[Any, float]:
    start_s = time.perf_counter()
    value = work()
    return value, time.perf_counter() - start_s


def _walk(
    fill: Callable[[], np.ndarray],
    accept: Callable[[int, int], None],
    done: Callable[[int], bool],
    vocab_size: int,
) -> list[float]:
    """Per-step fill times while every matcher takes a random allowed token."""
    rng = random.Random(0)
    times_s = []
    for _ in range(NUM_STEPS):
        bitmask, elapsed_s = _timed(fill)
        times_s.append(elapsed_s)
        for row in range(NUM_MATCHERS):
            if done(row):
                continue
            bits = np.unpackbits(bitmask[row].view(np.uint8), bitorder="little")[:vocab_size]
            accept(row, int(rng.choice(np.flatnonzero(bits))))
    return times_s


def _summary(times_s: list[float]) -> dict[str, float]:
    ordered = sorted(times_s)
    return {
        "mean_ms": 1e3 * statistics.fmean(ordered),
        "median_ms": 1e3 * statistics.median(ordered),
        "p90_ms": 1e3 * ordered[int(0.9 * len(ordered))],
        "max_ms": 1e3 * ordered[-1],
    }


def measure_llguidance(tokenizer: Any, vocab_size: int) -> dict[str, Any]:
    import llguidance
    import llguidance.hf
    import llguidance.numpy as llg_numpy

    from vacpack.structured.grammars import json_schema_grammar

    lltokenizer, tokenizer_s = _timed(lambda: llguidance.hf.from_tokenizer(tokenizer, vocab_size))
    matcher = llguidance.LLMatcher
    grammars = {
        "json_schema": json_schema_grammar(INVOICE_SCHEMA),
        "json_object": json_schema_grammar({"type": "object"}),
        "regex": matcher.grammar_from_regex(REGEX),
        "ebnf": llguidance.grammar_from("ebnf", GBNF),
    }
    compile_s = {
        name: _timed(lambda g=g: matcher(lltokenizer, g))[1] for name, g in grammars.items()
    }
    bitmask = llg_numpy.allocate_token_bitmask(NUM_MATCHERS, vocab_size)
    results = {"tokenizer_s": tokenizer_s, "compile_s": compile_s}
    executor = llguidance.LLExecutor(num_threads=2)
    for mode in ("serial", "thread_pool"):
        matchers = [matcher(lltokenizer, grammars["json_schema"]) for _ in range(NUM_MATCHERS)]

        def fill(matchers: list[Any] = matchers, mode: str = mode) -> np.ndarray:
            if mode == "serial":
                for row, m in enumerate(matchers):
                    llg_numpy.fill_next_token_bitmask(m, bitmask, row)
            else:
                pairs = list(zip(matchers, range(NUM_MATCHERS), strict=True))
                llg_numpy.fill_next_token_bitmask_par(executor, pairs, bitmask)
            return bitmask

        times_s = _walk(
            fill,
            lambda row, token, ms=matchers: ms[row].consume_token(token),
            lambda row, ms=matchers: ms[row].is_stopped(),
            vocab_size,
        )
        results[f"mask_{mode}"] = _summary(times_s)
    return results


def measure_xgrammar(tokenizer: Any, vocab_size: int) -> dict[str, Any]:
    import xgrammar

    info, tokenizer_s = _timed(
        lambda: xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    )
    compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    layout = {"any_whitespace": False, "separators": (JSON_LAYOUT[0], JSON_LAYOUT[1])}
    compiled, schema_s = _timed(lambda: compiler.compile_json_schema(INVOICE_SCHEMA, **layout))
    compile_s = {
        "json_schema": schema_s,
        "json_object": _timed(compiler.compile_builtin_json_grammar)[1],
        "regex": _timed(lambda: compiler.compile_regex(REGEX))[1],
        "ebnf": _timed(lambda: compiler.compile_grammar(GBNF))[1],
    }
    bitmask = xgrammar.allocate_token_bitmask(NUM_MATCHERS, vocab_size).numpy()
    results = {"tokenizer_s": tokenizer_s, "compile_s": compile_s}
    batch = xgrammar.BatchGrammarMatcher(max_threads=2)
    for mode in ("serial", "thread_pool"):
        matchers = [xgrammar.GrammarMatcher(compiled) for _ in range(NUM_MATCHERS)]

        def fill(matchers: list[Any] = matchers, mode: str = mode) -> np.ndarray:
            if mode == "serial":
                for row, m in enumerate(matchers):
                    m.fill_next_token_bitmask(bitmask, row)
            else:
                batch.batch_fill_next_token_bitmask(matchers, bitmask)
            return bitmask

        times_s = _walk(
            fill,
            lambda row, token, ms=matchers: ms[row].accept_token(token),
            lambda row, ms=matchers: ms[row].is_terminated(),
            vocab_size,
        )
        results[f"mask_{mode}"] = _summary(times_s)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", type=Path, default=None, help="default: the python BPE")
    parser.add_argument(
        "--output", type=Path, default=harness.REPO_ROOT / "bench/results/grammar_engines_cpu.json"
    )
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(args.tokenizer or python_bpe_tokenizer()))
    vocab_size = len(tokenizer)
    results: dict[str, Any] = {
        "machine": harness.machine_description(),
        "vocab_size": vocab_size,
        "num_matchers": NUM_MATCHERS,
        "num_steps": NUM_STEPS,
    }
    for name, measure in (("llguidance", measure_llguidance), ("xgrammar", measure_xgrammar)):
        log(f"measuring {name}")
        try:
            results[name] = measure(tokenizer, vocab_size)
        except ImportError as error:
            results[name] = {"skipped": f"not installed: {error}"}
        print(f"{name}: {json.dumps(results[name])}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
