"""E1's results: the cosine agreement between systems' embeddings, speed-up ratios, targets, the
markdown table and the chart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from e1_workload import (
    AGREEMENT_PAIRS,
    SAME_DTYPE_BASELINE,
    SAME_DTYPE_VLLM,
    TARGET_MIN_COSINE_FP32,
    TARGET_SPEEDUP_OVER_VLLM,
    TARGET_SPEEDUP_SAME_DTYPE,
)
from harness import (
    machine_summary,
    markdown_cell,
    save_bar_chart,
)


def cosine_agreement(embeddings: dict[str, np.ndarray]) -> dict[str, dict[str, float]]:
    """Min and mean cosine, text by text, between each pair's embeddings."""
    agreement = {}
    for system, reference in AGREEMENT_PAIRS:
        a, b = embeddings.get(system), embeddings.get(reference)
        if a is None or b is None or a.shape != b.shape:
            continue
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        cosines = (a64 * b64).sum(axis=1) / (
            np.linalg.norm(a64, axis=1) * np.linalg.norm(b64, axis=1)
        )
        agreement[f"{system} vs {reference}"] = {
            "min_cosine": float(cosines.min()),
            "mean_cosine": float(cosines.mean()),
        }
    return agreement


def speedup_ratios(systems: dict[str, dict[str, Any]]) -> dict[str, float]:
    ratios = {}
    pairs = [*SAME_DTYPE_BASELINE.items(), *SAME_DTYPE_VLLM.items()]
    for name, baseline_name in pairs:
        system, baseline = systems.get(name, {}), systems.get(baseline_name, {})
        if "texts_per_s" in system and "texts_per_s" in baseline:
            ratios[f"{name}/{baseline_name}"] = system["texts_per_s"] / baseline["texts_per_s"]
    return ratios


def target_checks(
    ratios: dict[str, float], agreement: dict[str, dict[str, float]]
) -> dict[str, Any]:
    checks: dict[str, Any] = {}
    for name, baseline_name in SAME_DTYPE_BASELINE.items():
        ratio = ratios.get(f"{name}/{baseline_name}")
        checks[f"texts_per_s {name}/{baseline_name}"] = {
            "target": f">= {TARGET_SPEEDUP_SAME_DTYPE}x",
            "measured": ratio,
            "met": None if ratio is None else ratio >= TARGET_SPEEDUP_SAME_DTYPE,
        }
    for name, vllm_name in SAME_DTYPE_VLLM.items():
        ratio = ratios.get(f"{name}/{vllm_name}")
        checks[f"texts_per_s {name}/{vllm_name}"] = {
            "target": f">= {TARGET_SPEEDUP_OVER_VLLM}x",
            "measured": ratio,
            "met": None if ratio is None else ratio >= TARGET_SPEEDUP_OVER_VLLM,
        }
    fp32 = agreement.get("vacpack_fp32 vs st_fp32", {}).get("min_cosine")
    checks["min_cosine vacpack_fp32 vs st_fp32"] = {
        "target": f">= {TARGET_MIN_COSINE_FP32}",
        "measured": fp32,
        "met": None if fp32 is None else fp32 >= TARGET_MIN_COSINE_FP32,
    }
    return checks


def markdown_table(results: dict[str, Any]) -> str:
    ratios = results["ratios"]
    memory_kind = "GPU" if results["workload"]["device"].startswith("cuda") else "RSS"
    lines = [
        f"| system | wall s | texts/s | tokens/s | padding | peak {memory_kind} GiB "
        "| vacpack speed-up (same dtype) | others' CPU |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, system in results["systems"].items():
        if "error" in system:
            lines.append(f"| {name} | failed: {markdown_cell(system['error'])} | | | | | | |")
            continue
        ratio = ratios.get(f"{name}/{SAME_DTYPE_BASELINE.get(name)}")
        ratio_text = f"{ratio:.2f}x" if ratio else "—"
        lines.append(
            f"| {name} | {system['wall_s']:.1f} | {system['texts_per_s']:,.1f} | "
            f"{system['tokens_per_s']:,.0f} | {system['padding_fraction']:.1%} | "
            f"{system['peak_memory_bytes'] / 2**30:.2f} | {ratio_text} | "
            f"{system['other_processes_core_share']:.0%} |"
        )
    lines.append("")
    for name, check in results["targets"].items():
        measured = check["measured"]
        measured_text = "n/a" if measured is None else f"{measured:.6g}"
        verdict = {True: "met", False: "NOT met", None: "not measured"}[check["met"]]
        lines.append(f"target {name}: {check['target']}; measured {measured_text}: {verdict}")
    for pair, cosines in results["cosine_agreement"].items():
        lines.append(
            f"cosine {pair}: min {cosines['min_cosine']:.6f}, mean {cosines['mean_cosine']:.6f}"
        )
    analysis = results["where_the_time_goes"]
    dtype = analysis["dtype"]
    for name, use in analysis["utilisation"].items():
        if use["mfu"] is not None:
            lines.append(
                f"{name}: {use['useful_tflops']:.3f} TFLOPS of model FLOPs, "
                f"MFU {use['mfu']:.0%} of the measured "
                f"{analysis['matmul_peak'].get('dtype', dtype)} matmul peak "
                f"({analysis['matmul_peak']['best_tflops']:.3f} TFLOPS)"
            )
    if analysis["mfu_needed_for_target"] is not None:
        lines.append(
            f"MFU vacpack_{dtype} needs for {TARGET_SPEEDUP_SAME_DTYPE}x st_{dtype}: "
            f"{analysis['mfu_needed_for_target']:.0%}"
        )
    for name, profile in analysis["profiles"].items():
        if "share_by_kind" in profile:
            shares = ", ".join(f"{k} {v:.0%}" for k, v in profile["share_by_kind"].items())
            lines.append(f"{name} (self CPU time, {profile['num_texts']} texts): {shares}")
    if not results["workload"]["systems_count_the_same_tokens"]:
        lines.append("WARNING: the systems ran different numbers of tokens (tokenization differs)")
    for name, system in results["systems"].items():
        report = system.get("job_report")
        if report:
            lines.append(
                f"{name} bins: {report['num_bins']} of at most {report['bin_budget_tokens']} "
                f"tokens ({report['budget_source']}); device busy "
                f"{report['device_busy_fraction']:.0%}"
            )
    return "\n".join(lines)


def save_plot(results: dict[str, Any], plot_path: Path) -> None:
    ran = {n: s for n, s in results["systems"].items() if "texts_per_s" in s}
    workload = results["workload"]
    save_bar_chart(
        {name: system["texts_per_s"] for name, system in ran.items()},
        plot_path,
        ylabel="texts/s",
        title=f"E1 (all-MiniLM-L6-v2, {workload['num_texts']:,} texts, 3..220 words)\n"
        f"{machine_summary(results['machine'], workload['device'])}",
        bar_labels=[
            f"{s['texts_per_s']:,.0f}\npadding {s['padding_fraction']:.1%}" for s in ran.values()
        ],
    )
