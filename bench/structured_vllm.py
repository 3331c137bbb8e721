"""The structured-outputs benchmark on vLLM's CPU build: the same prompts (token ids), sampling
(temperature 1, EOS ignored; vLLM samples from its engine seed, since its CPU sampler refuses
per-request seeds), max_tokens, JSON schema, dtype and step budget as vacpack's, unconstrained
and then constrained, run in vLLM's own environment (bench/vllm_cpu.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import vllm_cpu

from vacpack.config import EngineConfig
from vacpack.engine.engine import DEFAULT_BATCHED_TOKENS

VLLM_SYSTEM = "vllm_cpu"
# xgrammar is what vLLM's "auto" picks for this schema (auto falls back to another engine only
# for schema features xgrammar lacks), named here because vLLM fixes the JSON layout only with a
# named engine; "guidance" is llguidance, the grammar engine vacpack uses.
STRUCTURED_OUTPUTS_BACKENDS = ("xgrammar", "guidance")


def run_vllm_structured(
    *,
    model_dir: Path,
    prompts: list[list[int]],
    warmup_prompts: list[list[int]],
    schema: dict[str, Any],
    dtype: str,
    max_tokens: int,
    kv_cache_gib: float,
    backend: str,
    tokenizer_dir: Path | None,
) -> dict[str, Any]:
    """The worker's result: per batch, its timed section and output token ids."""
    more_engine_args = {} if tokenizer_dir is None else {"tokenizer": str(tokenizer_dir)}
    job = {
        "task": "structured",
        "model_dir": str(model_dir),
        "engine_args": vllm_cpu.engine_args(
            dtype=dtype,
            max_model_len=max(len(p) for p in [*prompts, *warmup_prompts]) + max_tokens,
            kv_cache_gib=kv_cache_gib,
            # vacpack's step budget on a CPU and its concurrency.
            max_num_batched_tokens=DEFAULT_BATCHED_TOKENS["cpu"],
            max_num_seqs=EngineConfig.max_num_seqs,
            # Both batches run the same prompts on one engine: with a prefix cache the second
            # would reuse the first's prompt KV and skip its prefill.
            enable_prefix_caching=False,
            structured_outputs_config={
                "backend": backend,
                # vacpack generates JSON in one fixed layout; vLLM's default lets a babbling
                # model emit whitespace between any two tokens, a different workload. This
                # fixes vLLM's layout too (its compact one: no spaces).
                "disable_any_whitespace": True,
            },
            **more_engine_args,
        ),
        "prompts": prompts,
        "warmup_prompts": warmup_prompts,
        "warmup_max_tokens": max_tokens,
        "max_tokens": max_tokens,
        "schema": schema,
    }
    return vllm_cpu.run_job(job, VLLM_SYSTEM, "structured")
