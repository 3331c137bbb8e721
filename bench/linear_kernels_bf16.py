"""The CPU's bf16 linear kernels side by side: oneDNN on a prepacked weight against vacpack's
VDPBF16PS kernel (cpu_kernels/gemm_bf16.c, AVX512-BF16 CPUs), bf16, on the linear layers of
Qwen2.5-0.5B (G1) and MiniLM (E1) at the row counts their steps run, each timed as the model
runs it (vacpack.models.linear_choice.linear_calls): every product reads its weight from
memory (the next of enough copies to fill the caches twice over), the MLP's gate/up
projection ends in silu(gate) * up (the C kernel's own; after oneDNN the fused elementwise
kernel's pass), MiniLM's up projection in its GELU (oneDNN's fused post-op; after the C kernel
PyTorch's). Each shape's kernels are interleaved, best of --rounds; the table gives ms, GFLOPS
and the C kernel's speed-up, a chart the GFLOPS.

    python bench/linear_kernels_bf16.py [--rounds 7] [--output PATH.json]
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import harness
import torch
from linear_kernels import best_times_s

from vacpack.cpu_kernels.elementwise import silu_and_mul
from vacpack.cpu_kernels.gemm import gemm_supported
from vacpack.models.linear_choice import LinearTiming, linear_calls, timed_out_features

RESULTS = harness.REPO_ROOT / "bench" / "results" / "linear_kernels_bf16_cpu.json"
KERNELS = ["onednn", "c_gemm_bf16"]
BF16 = torch.bfloat16
# (model, layer, in features, out features, activation, gated by)
LAYERS: tuple[tuple[str, str, int, int, str | None, str | None], ...] = (
    ("Qwen2.5-0.5B", "qkv", 896, 1152, None, None),
    ("Qwen2.5-0.5B", "o", 896, 896, None, None),
    ("Qwen2.5-0.5B", "gate_up + silu", 896, 9728, None, "silu"),
    ("Qwen2.5-0.5B", "down", 4864, 896, None, None),
    ("Qwen2.5-0.5B", "lm_head", 896, 151936, None, None),
    ("MiniLM-L6", "qkv", 384, 1152, None, None),
    ("MiniLM-L6", "up + gelu", 384, 1536, "gelu", None),
    ("MiniLM-L6", "down", 1536, 384, None, None),
)
DECODER_ROWS = (1, 4, 16, 64, 512, 2048)
ENCODER_ROWS = (512, 4096)


def measure(rounds: int) -> list[dict[str, Any]]:
    if not gemm_supported(BF16, BF16):
        raise SystemExit("the bf16 C kernel needs an AVX512-BF16 CPU and a C compiler")
    rows_out: list[dict[str, Any]] = []
    for model, layer, in_features, out_features, activation, gated_by in LAYERS:
        row_counts = ENCODER_ROWS if model == "MiniLM-L6" else DECODER_ROWS
        if layer == "lm_head":
            row_counts = tuple(n for n in row_counts if n <= 64)
        for num_rows in row_counts:
            timing = LinearTiming(
                in_features, out_features, BF16, (num_rows,), activation, gated_by
            )
            calls = linear_calls(timing, KERNELS, gate_pass=silu_and_mul if gated_by else None)
            best = best_times_s(calls, rounds)
            # A weight over 64 MiB (the LM head) is timed on a slice of its output features.
            timed_features = timed_out_features(timing)
            flops = 2 * num_rows * in_features * timed_features
            row = {
                "model": model,
                "layer": layer,
                "shape": f"[{num_rows}, {in_features}] x [{in_features}, {timed_features}]",
                "rows": num_rows,
                "best_ms": {k: s * 1e3 for k, s in best.items()},
                "gflops": {k: flops / s / 1e9 for k, s in best.items()},
                "c_gemm_bf16_speedup": best["onednn"] / best["c_gemm_bf16"],
            }
            harness.log(
                f"{model} {layer} {row['shape']}: onednn {row['best_ms']['onednn']:.3f} ms, "
                f"c_gemm_bf16 {row['best_ms']['c_gemm_bf16']:.3f} ms "
                f"({row['c_gemm_bf16_speedup']:.2f}x)"
            )
            rows_out.append(row)
    return rows_out


def markdown_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | layer | rows | oneDNN ms | C ms | oneDNN GFLOPS | C GFLOPS | C speed-up |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ms, gflops = r["best_ms"], r["gflops"]
        lines.append(
            f"| {r['model']} | {r['layer']} | {r['rows']} | {ms['onednn']:.3f} | "
            f"{ms['c_gemm_bf16']:.3f} | {gflops['onednn']:.0f} | {gflops['c_gemm_bf16']:.0f} | "
            f"{r['c_gemm_bf16_speedup']:.2f}x |"
        )
    return "\n".join(lines)


def save_plot(rows: list[dict[str, Any]], machine: Mapping[str, Any], path: Path) -> None:
    harness.save_paired_bar_chart(
        [f"{r['model'].split('-')[0]} {r['layer']}\n{r['rows']} rows" for r in rows],
        {
            "oneDNN, prepacked": [r["gflops"]["onednn"] for r in rows],
            "C, VDPBF16PS": [r["gflops"]["c_gemm_bf16"] for r in rows],
        },
        path,
        ylabel="GFLOPS (bf16)",
        title=f"Linear layers, bf16, {harness.machine_summary(machine)}",
    )


def main() -> int:
    return harness.kernel_benchmark_main(
        __doc__.split("\n\n")[0], 7, RESULTS, measure, save_plot, markdown_table
    )


if __name__ == "__main__":
    raise SystemExit(main())
