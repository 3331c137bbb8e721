"""The shared-prompt workload on vLLM's CPU build, prefix caching on as in vacpack's "on" run:
the same requests, greedy tokens, dtype and step budget, in vLLM's own environment
(bench/vllm_cpu.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import vllm_cpu

from vacpack.config import EngineConfig
from vacpack.engine.engine import DEFAULT_BATCHED_TOKENS

VLLM_SYSTEM = "vllm_cpu"
WARMUP_PROMPT: list[int] = [1, 2, 3]  # vacpack's worker warms up on the same request
WARMUP_OUTPUT_TOKENS = 2


def run_vllm_shared_prompt(
    model_dir: Path,
    prompts: list[list[int]],
    max_tokens: int,
    kv_cache_gib: float,
    dtype: str = "bfloat16",
) -> dict[str, Any]:
    job = {
        "task": "generate",
        "model_dir": str(model_dir),
        "engine_args": vllm_cpu.engine_args(
            dtype=dtype,
            max_model_len=max(len(p) for p in prompts) + max_tokens,
            kv_cache_gib=kv_cache_gib,
            max_num_batched_tokens=DEFAULT_BATCHED_TOKENS["cpu"],
            max_num_seqs=EngineConfig.max_num_seqs,
            enable_prefix_caching=True,
        ),
        "prompts": prompts,
        "warmup_prompts": [WARMUP_PROMPT],
        "warmup_max_tokens": WARMUP_OUTPUT_TOKENS,
        "max_tokens": max_tokens,
    }
    raw = vllm_cpu.run_job(job, f"shared_prompt/{VLLM_SYSTEM}", "prefix")
    if "error" in raw:
        return raw
    section = vllm_cpu.timed_section_of(raw)
    num_prompt = sum(len(p) for p in prompts)
    num_output = sum(len(tokens) for tokens in raw["output_token_ids"])
    num_cached = sum(raw["num_cached_prompt_tokens"])
    return {
        **section.fields(),
        "num_requests": len(prompts),
        "num_prompt_tokens": num_prompt,
        "num_output_tokens": num_output,
        "output_tokens_per_s": num_output / section.wall_s,
        "total_tokens_per_s": (num_prompt + num_output) / section.wall_s,
        "prefill_tokens_computed": num_prompt - num_cached,
        "cache_hit_rate": num_cached / num_prompt,
        **vllm_cpu.system_fields(raw),
    }
