"""E1's vLLM CPU systems: the same texts embedded by vLLM's CPU build (`runner="pooling"`,
`LLM.embed`, the model's own sentence-transformers pooling) in bfloat16 or float32, run in its
own environment (bench/vllm_cpu.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import vllm_cpu

# vLLM system -> the dtype it runs in, as LLM(dtype=) takes it.
VLLM_SYSTEMS: dict[str, str] = {"vllm_bf16": "bfloat16", "vllm_fp32": "float32"}


def run_vllm(
    args: argparse.Namespace,
    texts: list[str],
    warmup_texts: list[str],
    name: str,
    embeddings_output: Path,
) -> dict[str, Any]:
    if args.device.startswith("cuda"):
        return {"error": f"{name} is vLLM's CPU build: it runs only with --device cpu"}
    st_config = json.loads((args.model_dir / "sentence_bert_config.json").read_text())
    job = {
        "task": "embed",
        "model_dir": str(args.model_dir),
        "engine_args": vllm_cpu.engine_args(
            dtype=VLLM_SYSTEMS[name],
            # The model's own limit, as sentence-transformers applies it (no text here is longer).
            max_model_len=int(st_config["max_seq_length"]),
            kv_cache_gib=args.vllm_kv_cache_gib,
            # vacpack's bin budget where one is given; else vLLM's own default (reported).
            max_num_batched_tokens=args.max_num_batched_tokens,
            runner="pooling",
        ),
        "texts": texts,
        "warmup_texts": warmup_texts,
        "embeddings_output": str(embeddings_output),
    }
    raw = vllm_cpu.run_job(job, name, "e1")
    if "error" in raw:
        return raw
    section = vllm_cpu.timed_section_of(raw)
    return {
        **section.fields(),
        "num_real_tokens": raw["num_real_tokens"],
        "texts_per_s": len(texts) / section.wall_s,
        "tokens_per_s": raw["num_real_tokens"] / section.wall_s,
        "padding_fraction": 0.0,  # vLLM packs a step's tokens without padding too
        "peak_memory_bytes": raw["peak_rss_bytes"],
        **vllm_cpu.system_fields(raw),
    }
