"""G1's results: cross-system checks, speed-up ratios, prefill MFU, targets, the README table
and the chart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from g1_workload import (
    BASELINES,
    GENERATE_BATCH_SYSTEMS,
    SHAPE_LABELS,
    TARGET_PREFILL_MFU,
    TARGET_SPEEDUP_OVER_GENERATE_BATCH,
    count_non_embedding_params,
    prefill_model_flops,
    read_model_config,
)
from harness import (
    machine_summary,
    markdown_cell,
    save_bar_chart,
)


def first_token_agreement(systems: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Share of prompts whose first greedy token matches vacpack's: a check that all systems ran
    the same model on the same inputs (later tokens may drift on bfloat16 near-ties)."""
    reference = systems.get("vacpack", {}).get("first_output_tokens")
    agreement = {}
    for name in BASELINES:
        other = systems.get(name, {}).get("first_output_tokens")
        if reference and other and len(other) == len(reference):
            agreement[name] = sum(a == b for a, b in zip(reference, other, strict=True)) / len(
                reference
            )
    return agreement


def speedup_ratios(systems: dict[str, dict[str, Any]]) -> dict[str, float]:
    """vacpack's output tokens/s over each baseline's; every system counts the same tokens, so
    the total-tokens/s ratio and the inverse wall-time ratio are the same number."""
    vacpack = systems.get("vacpack", {})
    ratios = {}
    for name in BASELINES:
        baseline = systems.get(name, {})
        if "output_tokens_per_s" in vacpack and "output_tokens_per_s" in baseline:
            ratios[f"vacpack/{name}"] = (
                vacpack["output_tokens_per_s"] / baseline["output_tokens_per_s"]
            )
    return ratios


def vacpack_prefill_mfu(
    vacpack: dict[str, Any], model_dir: Path, prompts: list[list[int]], peak_tflops: float | None
) -> dict[str, Any]:
    config = read_model_config(model_dir)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    flops = prefill_model_flops(
        num_non_embedding_params=count_non_embedding_params(model_dir),
        num_prefill_tokens=vacpack["num_prefill_tokens"],
        prompt_lens=[len(p) for p in prompts],
        num_layers=config["num_hidden_layers"],
        attention_hidden_size=config["num_attention_heads"] * head_dim,
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        vocab_size=config["vocab_size"],
    )
    device_tflops = flops / vacpack["prefill_device_time_s"] / 1e12
    step_wall_tflops = flops / vacpack["prefill_step_wall_s"] / 1e12
    return {
        "prefill_device_time_s": vacpack["prefill_device_time_s"],
        "prefill_step_wall_s": vacpack["prefill_step_wall_s"],
        "num_prefill_tokens": vacpack["num_prefill_tokens"],
        "prefill_tokens_per_s": vacpack["num_prefill_tokens"] / vacpack["prefill_device_time_s"],
        "prefill_model_flops": flops,
        "prefill_tflops": device_tflops,
        "mfu": device_tflops / peak_tflops if peak_tflops else None,
        "prefill_tflops_step_wall": step_wall_tflops,
        "mfu_step_wall": step_wall_tflops / peak_tflops if peak_tflops else None,
    }


def target_entry(target: float, measured: float | None) -> dict[str, Any]:
    return {
        "target": target,
        "measured": measured,
        "met": measured is not None and measured >= target,
    }


def targets(results: dict[str, Any], applies: bool) -> dict[str, Any]:
    ratios = results["ratios"]
    batch_ratios = [
        ratios[f"vacpack/{n}"] for n in GENERATE_BATCH_SYSTEMS if f"vacpack/{n}" in ratios
    ]
    return {
        # The issue sets them for the GPU run; on a CPU they are shown, not judged.
        "applies": applies,
        "speedup_over_hf_generate_batch": target_entry(
            TARGET_SPEEDUP_OVER_GENERATE_BATCH, ratios.get("vacpack/hf_generate_batch")
        ),
        # Against whichever generate_batch setting ran faster here.
        "speedup_over_fastest_generate_batch": target_entry(
            TARGET_SPEEDUP_OVER_GENERATE_BATCH, min(batch_ratios) if batch_ratios else None
        ),
        "prefill_mfu": target_entry(
            TARGET_PREFILL_MFU, results.get("vacpack_prefill", {}).get("mfu")
        ),
    }


def markdown_table(results: dict[str, Any]) -> str:
    ratios = results["ratios"]
    workload = results["workload"]
    on_gpu = any("peak_gpu_memory_bytes" in s for s in results["systems"].values())
    lines = [
        f"G1 on {workload['device']}: {workload['model']}, {workload['num_prompts']} prompts x "
        f"{workload['max_tokens']} output tokens, prompts {workload['min_prompt_len']}.."
        f"{workload['max_prompt_len']} tokens ({workload['num_prompt_tokens']} in all)",
        "",
        "| system | wall s | output tok/s | total tok/s | vacpack speed-up | peak RSS GiB "
        + ("| peak GPU GiB " if on_gpu else "")
        + "| others' CPU |",
        "|---|---:|---:|---:|---:|---:|" + ("---:|" if on_gpu else "") + "---:|",
    ]
    for name, system in results["systems"].items():
        rss_gib = system.get("peak_rss_bytes", 0) / 2**30
        gpu_cell = f" {system.get('peak_gpu_memory_bytes', 0) / 2**30:.2f} |" if on_gpu else ""
        if "error" in system:
            lines.append(
                f"| {name} | failed: {markdown_cell(system['error'])} | | | | {rss_gib:.2f} |"
                f"{gpu_cell} |"
            )
            continue
        ratio = ratios.get(f"vacpack/{name}")
        ratio_text = "—" if name == "vacpack" else (f"{ratio:.2f}x" if ratio else "n/a")
        lines.append(
            f"| {name} | {system['wall_s']:.2f} | {system['output_tokens_per_s']:.1f} | "
            f"{system['total_tokens_per_s']:.1f} | {ratio_text} | {rss_gib:.2f} |{gpu_cell} "
            f"{system['other_processes_core_share']:.0%} |"
        )
    peak = results.get("matmul_peak", {})
    if "best_tflops" in peak:
        # Older results have no best_dtype: their peak is in the run's dtype.
        dtype = peak.get("best_dtype", results["workload"].get("dtype", "bfloat16"))
        lines.append(
            f"\nmatmul peak at the model's prefill shapes, {dtype} ({peak['timing']}): "
            f"{peak['best_tflops']:.3f} TFLOPS (others' CPU meanwhile: "
            f"{peak['other_processes_core_share']:.0%})"
        )
        if "reference_square" in peak:
            reference = peak["reference_square"]
            lines.append(f"reference {reference['shape']}: {reference['best_tflops']:.1f} TFLOPS")
    prefill = results.get("vacpack_prefill")
    if prefill:
        mfu_text = f"{prefill['mfu']:.1%}" if prefill["mfu"] is not None else "n/a"
        lines.append(
            f"vacpack prefill: {prefill['num_prefill_tokens']} tokens in "
            f"{prefill['prefill_device_time_s']:.3f} s of device time, "
            f"{prefill['prefill_tflops']:.3f} TFLOPS, MFU {mfu_text}"
            + (
                f" ({prefill['mfu_step_wall']:.1%} over the steps' whole host spans)"
                if prefill["mfu_step_wall"] is not None
                else ""
            )
        )
    vacpack = results["systems"].get("vacpack", {})
    if "timeline_summary" in vacpack:
        summary, engine = vacpack["timeline_summary"], vacpack["engine"]
        lines.append(
            f"vacpack timeline: {summary['num_steps']} steps, device busy "
            f"{summary['device_busy_fraction']:.1%}, mean idle gap "
            f"{summary['mean_idle_gap_s'] * 1e3:.3f} ms; attention "
            f"{engine['attention_backend']}, async scheduling "
            f"{'on' if engine['async_scheduling'] else 'off'}, CUDA graphs "
            f"{'on' if engine['cuda_graphs'] else 'off'}"
        )
    for name in GENERATE_BATCH_SYSTEMS:
        system = results["systems"].get(name, {})
        if "continuous_batching_config" in system:
            lines.append(
                f"{name} settings: asked {system['continuous_batching_config']}; "
                f"transformers settled on {system['continuous_batching_resolved'] or 'n/a'}; "
                f"flash packages: {system['flash_attention_packages'] or 'none'}"
            )
    for name, system in results["systems"].items():
        if "warning" in system:
            lines.append(f"WARNING {name}: {system['warning']}")
    if results.get("first_token_agreement"):
        agreement = ", ".join(f"{k} {v:.0%}" for k, v in results["first_token_agreement"].items())
        lines.append(f"first greedy token matching vacpack's: {agreement}")
    target = results["targets"]
    judged = "" if target["applies"] else " (targets are for the GPU run: not judged)"
    for name, entry in target.items():
        if name == "applies":
            continue
        measured = "n/a" if entry["measured"] is None else f"{entry['measured']:.3f}"
        lines.append(
            f"target {name} >= {entry['target']}: measured {measured}, "
            f"{'met' if entry['met'] else 'not met'}{judged}"
        )
    return "\n".join(lines)


def save_plot(results: dict[str, Any], plot_path: Path) -> None:
    ran = {n: s for n, s in results["systems"].items() if "output_tokens_per_s" in s}
    workload = results["workload"]
    save_bar_chart(
        {name: system["output_tokens_per_s"] for name, system in ran.items()},
        plot_path,
        ylabel="output tokens/s",
        title=f"G1 ({SHAPE_LABELS[workload['shape']]} shapes, "
        f"{workload.get('dtype', 'bfloat16')}, {workload['num_prompts']} "
        f"prompts x {workload['max_tokens']} tokens)\n"
        f"{machine_summary(results['machine'], workload['device'])}",
    )
