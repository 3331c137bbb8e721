"""The decode attention benchmark's results: the KV bytes a step must read, each path's achieved
KV read bandwidth against the copy bandwidth, the JSON file and the markdown table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from decode_attention_workload import HEAD_DIM, NUM_KV_HEADS, PAGE_SIZE, DecodeBatch


def kv_bytes_per_step(batch: DecodeBatch, num_layers: int, dtype: torch.dtype) -> int:
    """Keys and values of every distinct cached token the step attends to, in every layer:
    what a step must read at least once."""
    slots = {
        page * PAGE_SIZE + offset
        for table, context_len in zip(batch.page_tables, batch.context_lens, strict=True)
        for position in range(context_len)
        for page, offset in [(table[position // PAGE_SIZE], position % PAGE_SIZE)]
    }
    bytes_per_token = 2 * NUM_KV_HEADS * HEAD_DIM * dtype.itemsize  # keys and values
    return len(slots) * bytes_per_token * num_layers


def bandwidth(kv_bytes: int, ms_per_step: dict[str, dict[str, float]], copy: float) -> dict:
    """Each path's achieved KV read bandwidth, and its share of the copy bandwidth."""
    return {
        name: {
            "kv_read_gb_per_s": kv_bytes / (t["best_ms"] / 1e3) / 1e9,
            "share_of_copy": kv_bytes / (t["best_ms"] / 1e3) / 1e9 / copy,
        }
        for name, t in ms_per_step.items()
    }


def write_results(results: dict[str, Any], output: Path) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=2) + "\n")


def print_table(results: dict[str, Any]) -> None:
    print(
        "| workload | timing | path | best ms/step | median ms/step | speed-up "
        "| KV read GB/s | of copy GB/s |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for name, workload in results["workloads"].items():
        for setting, timing in workload["timings"].items():
            for path, t in timing["ms_per_step"].items():
                speedup = timing["speedup_vs_before"][path]
                achieved = timing["kv_bandwidth"][path]
                print(
                    f"| {name} | {setting} | {path} | {t['best_ms']:.1f} | {t['median_ms']:.1f} "
                    f"| {speedup:.2f}x | {achieved['kv_read_gb_per_s']:.3g} "
                    f"| {achieved['share_of_copy']:.0%} of {timing['copy_gb_per_s']:.1f} |"
                )
