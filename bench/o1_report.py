"""O1's results: the greedy agreement between configurations, the speed-ups, the target checks,
the markdown table, the bar chart, and where each configuration's timeline chart and JSON go."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness import (
    machine_summary,
    markdown_cell,
    save_bar_chart,
)
from o1_workload import REFERENCE_CONFIG, TARGET_DEVICE_BUSY_FRACTION, TARGET_OVERLAP_SPEEDUP


def timeline_paths(output_path: Path, config: str) -> tuple[Path, Path]:
    """Where a configuration's timeline chart and timeline JSON go, beside the results file."""
    stem = output_path.with_suffix("")
    return (
        stem.with_name(f"{stem.name}_timeline_{config}.png"),
        stem.with_name(f"{stem.name}_timeline_{config}.json"),
    )


def greedy_agreement(reference: list[list[int]], other: list[list[int]]) -> dict[str, Any]:
    """How many requests got exactly the reference's tokens, and where the first one differs."""
    num_identical = sum(a == b for a, b in zip(reference, other, strict=True))
    first_divergence = None
    for request_index, (a, b) in enumerate(zip(reference, other, strict=True)):
        if a != b:
            # Past the shorter list's end when one output is a prefix of the other.
            position = next(
                (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)),
            )
            first_divergence = {"request": request_index, "token_position": position}
            break
    return {
        "num_requests": len(reference),
        "num_identical": num_identical,
        "identical": num_identical == len(reference),
        "first_divergence": first_divergence,
    }


def compare_outputs(configs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each configuration's greedy outputs against the reference's; drops the token lists."""
    token_lists = {name: c.pop("output_token_ids", None) for name, c in configs.items()}
    reference = token_lists.get(REFERENCE_CONFIG)
    agreement = {}
    for name, tokens in token_lists.items():
        if name == REFERENCE_CONFIG or reference is None or tokens is None:
            continue
        agreement[f"{name} vs {REFERENCE_CONFIG}"] = greedy_agreement(reference, tokens)
    return agreement


def output_tokens_per_s(configs: dict[str, dict[str, Any]], name: str) -> float | None:
    return configs.get(name, {}).get("output_tokens_per_s")


def speedups(configs: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Ratios of output tokens/s; every configuration counts the same tokens."""
    pairs = {
        "overlap_on/overlap_off": ("overlap_on", "overlap_off"),
        "overlap_on/overlap_on_no_graphs": ("overlap_on", "overlap_on_no_graphs"),
    }
    ratios = {}
    for label, (numerator, denominator) in pairs.items():
        top, bottom = (
            output_tokens_per_s(configs, numerator),
            output_tokens_per_s(configs, denominator),
        )
        if top and bottom:
            ratios[label] = top / bottom
    return ratios


def targets(
    configs: dict[str, dict[str, Any]], ratios: dict[str, float], applies: bool
) -> dict[str, Any]:
    busy = configs.get("overlap_on", {}).get("timeline_summary", {}).get("device_busy_fraction")
    speedup = ratios.get("overlap_on/overlap_off")
    return {
        # The targets are set for the full-size run on CUDA; elsewhere they are shown, not judged.
        "applies": applies,
        "device_busy_fraction_overlap_on": {
            "target": TARGET_DEVICE_BUSY_FRACTION,
            "measured": busy,
            "met": busy is not None and busy >= TARGET_DEVICE_BUSY_FRACTION,
        },
        "speedup_overlap_on_vs_off": {
            "target": TARGET_OVERLAP_SPEEDUP,
            "measured": speedup,
            "met": speedup is not None and speedup >= TARGET_OVERLAP_SPEEDUP,
        },
    }


def markdown_table(results: dict[str, Any]) -> str:
    workload = results["workload"]
    lines = [
        f"O1 on {workload['device']} ({workload['scale']}): {workload['num_prompts']} requests x "
        f"{workload['max_tokens']} output tokens, prompts {workload['min_prompt_len']}.."
        f"{workload['max_prompt_len']} tokens ({workload['num_prompt_tokens']} in all)",
        "",
        "| configuration | async | CUDA graphs | wall s | output tok/s | device busy "
        "| mean idle gap ms | host prepare ms/step | host process ms/step | padded slots | steps |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, config in results["configs"].items():
        if "error" in config:
            lines.append(f"| {name} | failed: {markdown_cell(config['error'])} |||||||||")
            continue
        engine, summary = config["engine"], config["timeline_summary"]
        lines.append(
            f"| {name} | {'on' if engine['async_scheduling'] else 'off'} | "
            f"{'on' if engine['cuda_graphs'] else 'off'} | {config['wall_s']:.2f} | "
            f"{config['output_tokens_per_s']:.1f} | {summary['device_busy_fraction']:.1%} | "
            f"{summary['mean_idle_gap_s'] * 1e3:.3f} | "
            f"{summary['mean_host_prepare_s'] * 1e3:.2f} | "
            f"{summary['mean_host_process_s'] * 1e3:.2f} | {summary['padded_share']:.1%} | "
            f"{summary['num_steps']} |"
        )
    lines.append("")
    for label, ratio in results["speedups"].items():
        lines.append(f"speed-up {label}: {ratio:.3f}x")
    for label, agreement in results["greedy_agreement"].items():
        verdict = "identical" if agreement["identical"] else "DIFFER"
        lines.append(
            f"greedy outputs {label}: {verdict} "
            f"({agreement['num_identical']}/{agreement['num_requests']} requests identical"
            + (
                f"; first difference: request {agreement['first_divergence']['request']}, "
                f"token {agreement['first_divergence']['token_position']})"
                if agreement["first_divergence"]
                else ")"
            )
        )
    target = results["targets"]
    judged = "" if target["applies"] else " (targets are for the full-size CUDA run: not judged)"
    for name in ("device_busy_fraction_overlap_on", "speedup_overlap_on_vs_off"):
        entry = target[name]
        measured = "n/a" if entry["measured"] is None else f"{entry['measured']:.3f}"
        lines.append(
            f"target {name} >= {entry['target']}: measured {measured}, "
            f"{'met' if entry['met'] else 'not met'}{judged}"
        )
    for name, config in results["configs"].items():
        if config.get("all_outputs_full_length") is False:
            lines.append(f"WARNING {name}: not every request got {workload['max_tokens']} tokens")
    return "\n".join(lines)


def tokens_per_s_text(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def save_plot(results: dict[str, Any], plot_path: Path) -> None:
    ran = {n: c for n, c in results["configs"].items() if "output_tokens_per_s" in c}
    workload = results["workload"]
    save_bar_chart(
        {name: config["output_tokens_per_s"] for name, config in ran.items()},
        plot_path,
        ylabel="output tokens/s",
        title=f"O1 decode-heavy: {workload['num_prompts']} requests x {workload['max_tokens']} "
        f"tokens ({workload['scale']})\nQwen2.5-0.5B shapes, bf16, "
        f"{machine_summary(results['machine'], workload['device'])}",
        bar_labels=[
            f"{tokens_per_s_text(c['output_tokens_per_s'])} tok/s\n"
            f"busy {c['timeline_summary']['device_busy_fraction']:.1%}"
            for c in ran.values()
        ],
    )
