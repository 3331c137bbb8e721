"""G1's vLLM CPU system: the same prompts, greedy tokens, dtype and step budget as vacpack's, run
by vLLM's CPU build in its own environment (bench/vllm_cpu.py)."""

from __future__ import annotations

import argparse
from typing import Any

import vllm_cpu
import workers
from g1_workload import (
    WARMUP_OUTPUT_TOKENS,
    is_cuda,
    make_warmup_prompts,
    read_model_config,
    step_budget_tokens,
    throughput_fields,
)

from vacpack.config import EngineConfig

VLLM_SYSTEM = "vllm_cpu"


def run_vllm_cpu(
    args: argparse.Namespace, prompts: list[list[int]], budget: workers.RunBudget
) -> dict[str, Any]:
    if is_cuda(args.device):
        return {"error": "vllm_cpu is vLLM's CPU build: it runs only with --device cpu"}
    vocab_size = int(read_model_config(args.model_dir)["vocab_size"])
    job = {
        "task": "generate",
        "model_dir": str(args.model_dir),
        "engine_args": vllm_cpu.engine_args(
            dtype=args.dtype,
            max_model_len=args.max_prompt_len + args.max_tokens,
            kv_cache_gib=args.vllm_kv_cache_gib,
            # vacpack's step budget and concurrency, and its prefix cache (on by default).
            max_num_batched_tokens=step_budget_tokens(args),
            max_num_seqs=EngineConfig.max_num_seqs,
            enable_prefix_caching=EngineConfig.enable_prefix_caching,
        ),
        "prompts": prompts,
        "warmup_prompts": make_warmup_prompts(args, vocab_size) if args.warmup else [],
        "warmup_max_tokens": WARMUP_OUTPUT_TOKENS,
        "max_tokens": args.max_tokens,
    }
    raw = vllm_cpu.run_job(job, VLLM_SYSTEM, "g1", budget, args.worker_timeout_s)
    if "error" in raw:
        return raw
    result = throughput_fields(
        vllm_cpu.timed_section_of(raw), prompts, raw["output_token_ids"], args.max_tokens
    )
    return result | vllm_cpu.system_fields(raw)
