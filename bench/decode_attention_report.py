"""The decode attention benchmark's results: the KV bytes a step must read, each path's achieved
KV read bandwidth against the copy and read-only bandwidths, the JSON file and the markdown
table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import harness
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


def bandwidth(
    kv_bytes: dict[str, int], ms_per_step: dict[str, dict[str, float]], probes: dict[str, float]
) -> dict:
    """Each path's achieved KV read bandwidth (its step's KV bytes over its best time), and its
    shares of the copy and read-only bandwidths (their best: decode_attention.probe_gb_per_s);
    also its median step's bandwidth against the median copy, the host under its usual load."""
    result = {}
    for name, t in ms_per_step.items():
        best_gb_per_s = kv_bytes[name] / t["best_ms"] / 1e6
        median_gb_per_s = kv_bytes[name] / t["median_ms"] / 1e6
        result[name] = {
            "kv_read_gb_per_s": best_gb_per_s,
            "share_of_copy": best_gb_per_s / probes["copy_gb_per_s"],
            "share_of_read": best_gb_per_s / probes["read_gb_per_s"],
            "share_of_median_copy_at_median": median_gb_per_s / probes["copy_gb_per_s_median"],
        }
    return result


def write_results(results: dict[str, Any], output: Path) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=2) + "\n")


def print_table(results: dict[str, Any]) -> None:
    print(
        "| workload | timing | path | best ms/step | median ms/step | speed-up "
        "| KV read GB/s | of copy GB/s | of read GB/s |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for name, workload in results["workloads"].items():
        for setting, timing in workload["timings"].items():
            for path, t in timing["ms_per_step"].items():
                speedup = timing["speedup_vs_before"][path]
                achieved = timing["kv_bandwidth"][path]
                print(
                    f"| {name} | {setting} | {path} | {t['best_ms']:.1f} | {t['median_ms']:.1f} "
                    f"| {speedup:.2f}x | {achieved['kv_read_gb_per_s']:.3g} "
                    f"| {achieved['share_of_copy']:.0%} of {timing['copy_gb_per_s']:.1f} "
                    f"| {achieved['share_of_read']:.0%} of {timing['read_gb_per_s']:.1f} |"
                )


def save_plots(results: dict[str, Any], output: Path) -> list[Path]:
    """One chart per workload: each path's best ms per step with the first (2-thread, wall
    clock) setting, labelled with its KV read bandwidth's share of the copy and read-only
    bandwidths. Written beside the JSON file as <stem>_<workload>.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for name, workload in results["workloads"].items():
        setting, timing = next(iter(workload["timings"].items()))
        ms = {path: t["best_ms"] for path, t in timing["ms_per_step"].items()}
        shares = timing["kv_bandwidth"]
        figure, axes = plt.subplots(figsize=(9, 0.4 * len(ms) + 1.6))
        bars = axes.barh(list(ms), list(ms.values()), color="tab:blue")
        axes.bar_label(
            bars,
            labels=[
                f" {t:.0f} ms: {shares[path]['share_of_copy']:.0%} of copy, "
                f"{shares[path]['share_of_read']:.0%} of read"
                for path, t in ms.items()
            ],
            fontsize=7,
        )
        axes.invert_yaxis()
        axes.tick_params(axis="y", labelsize=7)
        axes.set_xlim(0, max(ms.values()) * 1.45)
        axes.set_xlabel(
            f"ms per {workload['num_layers']}-layer decode step, best of the rounds "
            f"(copy {timing['copy_gb_per_s']:.1f} GB/s, read {timing['read_gb_per_s']:.1f} GB/s)"
        )
        axes.set_title(
            f"Decode attention, {name}, {results['dtype']}, {setting}\n"
            f"{harness.machine_summary(results['machine'])}",
            fontsize=9,
        )
        figure.tight_layout()
        plot = output.with_name(f"{output.stem}_{name}.png")
        figure.savefig(plot, dpi=120)
        plt.close(figure)
        paths.append(plot)
    return paths
