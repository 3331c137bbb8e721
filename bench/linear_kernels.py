"""The CPU linear kernels side by side: oneDNN on a prepacked weight against vacpack's C kernel
(cpu_kernels/gemm_f32.c), float32, on the linear layers of Qwen2.5-0.5B (G1) and MiniLM (E1)
at the row counts their steps run: 1 to 64 rows for decode steps, 512 and 2,048 for prefill
slices and bins; and the C kernel on the same weights kept in bfloat16 (float32 arithmetic, as
a bfloat16 model runs on a CPU without bfloat16 instructions). Each shape's kernels are
interleaved, best of --rounds; the table gives ms, GFLOPS, the C kernel's speed-up and the
bfloat16 weights' time against float32's, and a plot the GFLOPS of each.

    python bench/linear_kernels.py [--rounds 7] [--output bench/results/linear_kernels_cpu.json]
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import harness
import torch

from vacpack.models.cpu_prepack import LinearKernel, packed_linear, prepack

RESULTS = harness.REPO_ROOT / "bench" / "results" / "linear_kernels_cpu.json"
# Each kernel and the dtype its weights are kept in (the arithmetic is float32 in all three).
KERNELS: dict[str, tuple[LinearKernel, torch.dtype]] = {
    "onednn": ("onednn", torch.float32),
    "c_gemm": ("c_gemm", torch.float32),
    "c_gemm_bf16_weights": ("c_gemm", torch.bfloat16),
}
# (model, layer, in features, out features, activation): the layers of each model's blocks and
# Qwen's vocabulary projection (decode rows only: a prefill projects only its last tokens).
LAYERS: tuple[tuple[str, str, int, int, str | None], ...] = (
    ("Qwen2.5-0.5B", "qkv", 896, 1152, None),
    ("Qwen2.5-0.5B", "o", 896, 896, None),
    ("Qwen2.5-0.5B", "gate_up", 896, 9728, None),
    ("Qwen2.5-0.5B", "down", 4864, 896, None),
    ("Qwen2.5-0.5B", "lm_head", 896, 151936, None),
    ("MiniLM-L6", "qkv", 384, 1152, None),
    ("MiniLM-L6", "up + gelu", 384, 1536, "gelu"),
    ("MiniLM-L6", "down", 1536, 384, None),
)
DECODER_ROWS = (1, 16, 64, 512, 2048)
ENCODER_ROWS = (512, 4096)


def best_times_s(calls: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Each call's best time over `rounds`, the calls interleaved in every round."""
    for call in calls.values():
        call()  # first-call costs (kernel build, allocator growth) outside the timing
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(rounds):
        for name, call in calls.items():
            start_s = time.perf_counter()
            call()
            best[name] = min(best[name], time.perf_counter() - start_s)
    return best


def measure(rounds: int) -> list[dict[str, Any]]:
    generator = torch.Generator().manual_seed(0)
    rows_out: list[dict[str, Any]] = []
    for model, layer, in_features, out_features, activation in LAYERS:
        weight = torch.randn(out_features, in_features, generator=generator) * 0.02
        bias = torch.zeros(out_features) if activation else None
        packed = {
            name: prepack(weight.to(dtype), kernel) for name, (kernel, dtype) in KERNELS.items()
        }
        row_counts = ENCODER_ROWS if model == "MiniLM-L6" else DECODER_ROWS
        if layer == "lm_head":
            row_counts = tuple(n for n in row_counts if n <= 64)
        for num_rows in row_counts:
            x = torch.randn(num_rows, in_features, generator=generator)
            calls: dict[str, Callable[[], object]] = {
                kernel: functools.partial(packed_linear, x, w, bias, activation)
                for kernel, w in packed.items()
                if w is not None
            }
            best = best_times_s(calls, rounds)
            flops = 2 * num_rows * in_features * out_features
            row = {
                "model": model,
                "layer": layer,
                "shape": f"[{num_rows}, {in_features}] x [{in_features}, {out_features}]",
                "rows": num_rows,
                "best_ms": {k: s * 1e3 for k, s in best.items()},
                "gflops": {k: flops / s / 1e9 for k, s in best.items()},
                "c_gemm_speedup": best["onednn"] / best["c_gemm"],
                "bf16_weights_time_ratio": best["c_gemm_bf16_weights"] / best["c_gemm"],
            }
            harness.log(
                f"{model} {layer} {row['shape']}: onednn {row['best_ms']['onednn']:.2f} ms, "
                f"c_gemm {row['best_ms']['c_gemm']:.2f} ms ({row['c_gemm_speedup']:.2f}x), "
                f"on bf16 weights {row['best_ms']['c_gemm_bf16_weights']:.2f} ms"
            )
            rows_out.append(row)
    return rows_out


def markdown_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | layer | rows | oneDNN ms | C ms | C on bf16 weights ms | oneDNN GFLOPS | "
        "C GFLOPS | C speed-up | bf16 weights' time |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ms, gflops = r["best_ms"], r["gflops"]
        lines.append(
            f"| {r['model']} | {r['layer']} | {r['rows']} | {ms['onednn']:.2f} | "
            f"{ms['c_gemm']:.2f} | {ms['c_gemm_bf16_weights']:.2f} | {gflops['onednn']:.0f} | "
            f"{gflops['c_gemm']:.0f} | {r['c_gemm_speedup']:.2f}x | "
            f"{r['bf16_weights_time_ratio']:.2f}x |"
        )
    return "\n".join(lines)


def save_plot(rows: list[dict[str, Any]], machine: Mapping[str, Any], path: Path) -> None:
    harness.save_paired_bar_chart(
        [f"{r['model'].split('-')[0]} {r['layer']}\n{r['rows']} rows" for r in rows],
        {
            "oneDNN, prepacked": [r["gflops"]["onednn"] for r in rows],
            "C": [r["gflops"]["c_gemm"] for r in rows],
            "C, bfloat16 weights": [r["gflops"]["c_gemm_bf16_weights"] for r in rows],
        },
        path,
        ylabel="GFLOPS (float32)",
        title=f"Linear layers, float32, {harness.machine_summary(machine)}",
    )


def main() -> int:
    return harness.kernel_benchmark_main(
        __doc__.split("\n\n")[0], 7, RESULTS, measure, save_plot, markdown_table
    )


if __name__ == "__main__":
    raise SystemExit(main())
