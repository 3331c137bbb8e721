"""S1's results: the speed-up ratios, the README table and the chart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness import (
    machine_summary,
    markdown_cell,
    save_bar_chart,
)
from s1_workload import SYSTEMS


def speedups(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Per level: how many times vacpack's throughput, and how many times fewer its latencies."""
    systems = results["systems"]
    if any("levels" not in systems.get(name, {}) for name in SYSTEMS):
        return []
    rows = []
    for ours, theirs in zip(
        systems["vacpack"]["levels"], systems["transformers_serve"]["levels"], strict=True
    ):
        rows.append(
            {
                "concurrency": ours["concurrency"],
                "output_tokens_per_s": ours["output_tokens_per_s"] / theirs["output_tokens_per_s"],
                "requests_per_s": ours["requests_per_s"] / theirs["requests_per_s"],
                "ttft_p50": theirs["ttft_p50_s"] / ours["ttft_p50_s"],
                "tpot_p50": theirs["tpot_p50_s"] / ours["tpot_p50_s"],
            }
        )
    return rows


def markdown_table(results: dict[str, Any]) -> str:
    columns = ["clients", "server", "requests/s", "output tok/s", "TTFT p50 s", "TTFT p99 s"]
    columns += ["TPOT p50 ms", "TPOT p99 ms", "ITL p99 ms", "vacpack speed-up (tok/s)"]
    lines = ["| " + " | ".join(columns) + " |", "|---:|---|" + "---:|" * (len(columns) - 2)]
    speedup_by_level = {row["concurrency"]: row for row in results["speedups"]}
    levels, failures = [], []
    for name, system in results["systems"].items():
        if "error" in system:
            failures.append(f"| — | {name} | {markdown_cell(system['error'])} |" + " |" * 7)
            continue
        levels += [(level["concurrency"], name, level) for level in system["levels"]]
    for concurrency, name, level in sorted(levels, key=lambda item: item[0]):
        speedup = speedup_by_level.get(concurrency)
        ratio = (
            f"{speedup['output_tokens_per_s']:.2f}x"
            if speedup and name == "transformers_serve"
            else "—"
        )
        lines.append(
            f"| {concurrency} | {name} | {level['requests_per_s']:.2f} "
            f"| {level['output_tokens_per_s']:.1f} | {level['ttft_p50_s']:.2f} "
            f"| {level['ttft_p99_s']:.2f} | {level['tpot_p50_s'] * 1e3:.0f} "
            f"| {level['tpot_p99_s'] * 1e3:.0f} | {level['itl_p99_s'] * 1e3:.0f} | {ratio} |"
        )
    return "\n".join(lines + failures)


def save_plot(results: dict[str, Any], plot_path: Path) -> None:
    values = {
        f"{name}\n{level['concurrency']} clients": level["output_tokens_per_s"]
        for name, system in results["systems"].items()
        for level in system.get("levels", ())
    }
    workload = results["workload"]
    save_bar_chart(
        values,
        plot_path,
        ylabel="output tokens/s",
        title=(
            f"S1: streaming /v1/completions, {workload['num_requests']} requests per level, "
            f"{workload['max_tokens']} output tokens\n"
            f"{machine_summary(results['machine'])}"
        ),
    )
