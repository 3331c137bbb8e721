"""P1's results: how far each baseline's log-likelihoods are from vacpack's, speed-up ratios,
targets, the markdown table and the chart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness import (
    machine_summary,
    markdown_cell,
    save_bar_chart,
)
from p1_workload import (
    BASELINES,
    TARGET_MAX_PADDING_FRACTION,
    TARGET_SPEEDUP_OVER_PADDED,
)


def logprob_agreement(systems: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """How far each baseline's per-document totals are from vacpack's (bf16: close, not equal)."""
    reference = systems.get("vacpack", {}).get("document_logprobs")
    agreement: dict[str, Any] = {}
    for name in BASELINES:
        other = systems.get(name, {}).get("document_logprobs")
        if not reference or not other or len(other) != len(reference):
            continue
        pairs = list(zip(reference, other, strict=True))
        agreement[name] = {
            "max_abs_diff_nats": max(abs(a - b) for a, b in pairs),
            "max_relative_diff": max(abs(a - b) / max(abs(a), 1e-9) for a, b in pairs),
        }
    return agreement


def ratios_over_baselines(systems: dict[str, dict[str, Any]]) -> dict[str, float]:
    vacpack = systems.get("vacpack", {})
    ratios = {}
    for name in BASELINES:
        baseline = systems.get(name, {})
        if "tokens_per_s" in vacpack and "tokens_per_s" in baseline:
            ratios[f"vacpack/{name}"] = vacpack["tokens_per_s"] / baseline["tokens_per_s"]
    return ratios


def target_checks(systems: dict[str, dict[str, Any]], ratios: dict[str, float]) -> dict[str, Any]:
    vacpack, padded = systems.get("vacpack", {}), systems.get("hf_padded", {})
    speedup = ratios.get("vacpack/hf_padded")
    peak, baseline_peak = vacpack.get("peak_memory_bytes"), padded.get("peak_memory_bytes")
    padding = vacpack.get("padding_fraction")
    return {
        "tokens_per_s_over_hf_padded": {
            "target": f">= {TARGET_SPEEDUP_OVER_PADDED}x",
            "measured": speedup,
            "met": None if speedup is None else speedup >= TARGET_SPEEDUP_OVER_PADDED,
        },
        "vacpack_padding_fraction": {
            "target": f"< {TARGET_MAX_PADDING_FRACTION:.0%}",
            "measured": padding,
            "met": None if padding is None else padding < TARGET_MAX_PADDING_FRACTION,
        },
        "peak_memory_vs_hf_padded": {
            "target": "vacpack's peak memory <= hf_padded's",
            "measured": None if not (peak and baseline_peak) else peak / baseline_peak,
            "met": None if not (peak and baseline_peak) else peak <= baseline_peak,
        },
    }


def markdown_table(results: dict[str, Any]) -> str:
    ratios = results["ratios"]
    memory_kind = "GPU" if results["workload"]["device"].startswith("cuda") else "RSS"
    lines = [
        f"| system | wall s | tokens/s | docs/s | padding | peak {memory_kind} GiB "
        "| vacpack speed-up | others' CPU |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, system in results["systems"].items():
        if "error" in system:
            lines.append(f"| {name} | failed: {markdown_cell(system['error'])} | | | | | | |")
            continue
        ratio = ratios.get(f"vacpack/{name}")
        ratio_text = "—" if name == "vacpack" else (f"{ratio:.2f}x" if ratio else "n/a")
        lines.append(
            f"| {name} | {system['wall_s']:.1f} | {system['tokens_per_s']:,.0f} | "
            f"{system['documents_per_s']:.2f} | {system['padding_fraction']:.1%} | "
            f"{system['peak_memory_bytes'] / 2**30:.2f} | {ratio_text} | "
            f"{system['other_processes_core_share']:.0%} |"
        )
    lines.append("")
    for name, check in results["targets"].items():
        measured = check["measured"]
        measured_text = "n/a" if measured is None else f"{measured:.3g}"
        verdict = {True: "met", False: "NOT met", None: "not measured"}[check["met"]]
        lines.append(f"target {name}: {check['target']}; measured {measured_text}: {verdict}")
    for name, agreement in results["logprob_agreement"].items():
        lines.append(
            f"per-document total logprob, vacpack vs {name}: max abs diff "
            f"{agreement['max_abs_diff_nats']:.3g} nats "
            f"(relative {agreement['max_relative_diff']:.2g})"
        )
    report = results["systems"].get("vacpack", {}).get("job_report")
    if report:
        lines.append(
            f"vacpack bins: {report['num_bins']} of at most {report['bin_budget_tokens']} tokens "
            f"({report['budget_source']}); device busy {report['device_busy_fraction']:.0%}, "
            f"waited {report['wait_for_bins_s']:.2f} s for bins"
        )
    if not results["workload"]["prefix_token_ids_agree"]:
        lines.append("WARNING: the systems scored after different prefix tokens")
    if results["systems"].get("vacpack", {}).get("every_token_scored") is False:
        lines.append("WARNING: vacpack did not score every token of every document")
    lines.append(f"note: {results['notes']['peak_memory']}")
    return "\n".join(lines)


def save_plot(results: dict[str, Any], plot_path: Path) -> None:
    ran = {n: s for n, s in results["systems"].items() if "tokens_per_s" in s}
    workload = results["workload"]
    save_bar_chart(
        {name: system["tokens_per_s"] for name, system in ran.items()},
        plot_path,
        ylabel="scored tokens/s (real tokens only)",
        title=f"P1 (Qwen2.5-0.5B shapes, bf16, {workload['num_docs']} documents, "
        f"{workload['num_real_tokens']:,} tokens)\n"
        f"{machine_summary(results['machine'], workload['device'])}",
        bar_labels=[
            f"{s['tokens_per_s']:,.0f}\npadding {s['padding_fraction']:.1%}" for s in ran.values()
        ],
    )
