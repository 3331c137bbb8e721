"""P1's workload: the systems, the documents (a seeded corpus of random token ids, short and long
alternating), the prefix token every document is scored after, the warm-up, and the targets.
Shared by the orchestrator, its workers and the report."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import harness
import torch

SYSTEMS: tuple[str, ...] = ("vacpack", "hf_padded", "hf_sorted", "vllm_cpu")
BASELINES: tuple[str, ...] = ("hf_padded", "hf_sorted", "vllm_cpu")
# Run in its own environment rather than as a worker of this script.
VLLM_SYSTEMS: tuple[str, ...] = ("vllm_cpu",)

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "bench" / "results"

CORPUS_SEED = 0
DEFAULT_NUM_DOCS = {"cpu": 128, "cuda": 400}
PAD_TOKEN_ID = 0  # right padding: masked out of attention and out of the scores
# The warm-up job: two documents cut to this many tokens. Enough to run every kernel once and,
# for vacpack, to trigger the bin-budget probe, so none of that lands in the timed job.
WARMUP_DOCS = 2
WARMUP_TOKENS = 64

# What P1 sets out to show, checked against the measured numbers.
TARGET_SPEEDUP_OVER_PADDED = 3.0
TARGET_MAX_PADDING_FRACTION = 0.01


def log(message: str) -> None:
    harness.log(message, "p1")


def make_documents(
    num_docs: int,
    short_range_tokens: tuple[int, int],
    long_range_tokens: tuple[int, int],
    vocab_size: int,
) -> list[list[int]]:
    """Random token-id documents, short and long alternating, then shuffled.

    A pure function of its arguments, so every worker builds the same corpus.
    """
    generator = torch.Generator().manual_seed(CORPUS_SEED)
    documents = []
    for index in range(num_docs):
        low, high = short_range_tokens if index % 2 == 0 else long_range_tokens
        num_tokens = int(torch.randint(low, high + 1, (1,), generator=generator))
        documents.append(torch.randint(0, vocab_size, (num_tokens,), generator=generator).tolist())
    order = torch.randperm(num_docs, generator=generator).tolist()
    return [documents[i] for i in order]


def read_model_config(model_dir: Path) -> dict[str, Any]:
    return json.loads((model_dir / "config.json").read_text())


def prefix_token_id(model_dir: Path) -> int:
    """The token every document is scored after: BOS, else EOS (LoglikelihoodTask's rule)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prefix = tokenizer.bos_token_id
    if prefix is None:
        prefix = tokenizer.eos_token_id
    if prefix is None:
        raise ValueError(f"the tokenizer in {model_dir} has neither a BOS nor an EOS token")
    return int(prefix)


def corpus_for(args: argparse.Namespace) -> list[list[int]]:
    vocab_size = int(read_model_config(args.model_dir)["vocab_size"])
    return make_documents(
        args.num_docs,
        (args.short_min, args.short_max),
        (args.long_min, args.long_max),
        vocab_size,
    )
