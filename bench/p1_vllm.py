"""P1's vLLM CPU system: every document's log-likelihood after the same prefix token, from
vLLM's `prompt_logprobs=0` (the actual token's log-probability at each position), in bfloat16,
run by vLLM's CPU build in its own environment (bench/vllm_cpu.py)."""

from __future__ import annotations

import argparse
from typing import Any

import vllm_cpu

VLLM_SYSTEM = "vllm_cpu"


def run_vllm_cpu(
    args: argparse.Namespace, sequences: list[list[int]], warmup_sequences: list[list[int]]
) -> dict[str, Any]:
    """`sequences` are the documents with the prefix token in front, as the other systems run
    them; vLLM also samples one token per request, the least it generates."""
    if args.device.startswith("cuda"):
        return {"error": "vllm_cpu is vLLM's CPU build: it runs only with --device cpu"}
    job = {
        "task": "score",
        "model_dir": str(args.model_dir),
        "engine_args": vllm_cpu.engine_args(
            dtype=args.dtype,
            max_model_len=max(len(s) for s in sequences) + 1,
            kv_cache_gib=args.vllm_kv_cache_gib,
            # vacpack's bin budget where one is given; else vLLM's own default (reported).
            max_num_batched_tokens=args.max_num_batched_tokens,
        ),
        "prompts": sequences,
        "warmup_prompts": warmup_sequences,
    }
    raw = vllm_cpu.run_job(job, VLLM_SYSTEM, "p1")
    if "error" in raw:
        return raw
    section = vllm_cpu.timed_section_of(raw)
    num_real_tokens = sum(len(s) for s in sequences)
    return {
        **section.fields(),
        "num_real_tokens": num_real_tokens,
        "num_padding_tokens": 0,  # vLLM packs a step's tokens without padding too
        "tokens_per_s": num_real_tokens / section.wall_s,
        "documents_per_s": len(sequences) / section.wall_s,
        "padding_fraction": 0.0,
        "peak_memory_bytes": raw["peak_rss_bytes"],
        "prefix_token_id": sequences[0][0],
        "document_logprobs": raw["document_logprobs"],
        **vllm_cpu.system_fields(raw),
    }
