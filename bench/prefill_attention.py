"""Prefill and encoder attention alone, per layer: the C kernels (bf16 on AVX-512 registers or on
AMX tiles, float32 on any CPU) against PyTorch's SDPA and SDPA as blocked matmuls, each where it
runs here, on a packed bin of the shapes the measured selection (vacpack/attention/selection.py)
times: Qwen2.5-0.5B's grouped heads (14 query heads over 2 KV heads of 64 dims) on causal
prefills, all-MiniLM-L6-v2's (12 heads of 32) on bidirectional texts; bf16 and float32.

The candidates of each shape run interleaved, best of --rounds. The table gives ms per layer,
GFLOPS (the two products of the causal or full score matrix) and each candidate's time against
the fastest; the chart the GFLOPS. On an AMX CPU this is the A/B of the AMX kernel against the
AVX-512 one and SDPA's oneDNN flash kernel (which runs on AMX there).

    python bench/prefill_attention.py [--rounds 7] [--output PATH.json]
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import harness
import torch
from linear_kernels import best_times_s

from vacpack.attention import create_backend
from vacpack.attention.backend import AttentionBackend
from vacpack.attention.timed_steps import AttentionShapes, PackedBinShape, timed_calls
from vacpack.cpu_kernels import tile_kernel_ready, varlen_attention_supported

RESULTS = harness.REPO_ROOT / "bench" / "results" / "prefill_attention_cpu.json"
CPU = torch.device("cpu")
# (label, query heads, KV heads, head dim, sequences, tokens each, causal)
SHAPES: tuple[tuple[str, int, int, int, int, int, bool], ...] = (
    ("Qwen2.5-0.5B, 2 x 1,024 causal", 14, 2, 64, 2, 1024, True),
    ("Qwen2.5-0.5B, 1 x 2,048 causal", 14, 2, 64, 1, 2048, True),
    ("MiniLM, 32 x 128 bidirectional", 12, 12, 32, 32, 128, False),
    ("MiniLM, 16 x 256 bidirectional", 12, 12, 32, 16, 256, False),
)
DTYPES = (torch.bfloat16, torch.float32)


def candidates(shapes: AttentionShapes, causal: bool) -> dict[str, Callable[[], AttentionBackend]]:
    """Every implementation that runs this shape here, by name."""
    found: dict[str, Callable[[], AttentionBackend]] = {}
    kernel = functools.partial(create_backend, "cpu_kernels", cascade=None)
    if shapes.dtype == torch.bfloat16:
        if varlen_attention_supported(CPU, shapes.dtype, shapes.head_dim, "avx512_bf16"):
            found["C kernel, AVX-512 BF16"] = functools.partial(kernel, bf16_kernel="avx512_bf16")
        if tile_kernel_ready("amx") and shapes.head_dim % 32 == 0:
            found["C kernel, AMX tiles"] = functools.partial(kernel, bf16_kernel="amx")
    elif varlen_attention_supported(CPU, shapes.dtype, shapes.head_dim):
        found["C kernel, float32"] = kernel
    found["SDPA"] = functools.partial(create_backend, "torch_sdpa", blocked_prefill=False)
    if causal:
        found["blocked matmuls"] = functools.partial(
            create_backend, "torch_sdpa", blocked_prefill=True
        )
    return found


def flops(num_heads: int, head_dim: int, num_seqs: int, seq_len: int, causal: bool) -> float:
    """Both products over the scores a query sees: 2 flops per multiply-add, two products."""
    pairs = seq_len * (seq_len + 1) / 2 if causal else seq_len * seq_len
    return 4.0 * num_seqs * num_heads * head_dim * pairs


def measure(rounds: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for dtype in DTYPES:
        for label, heads, kv_heads, head_dim, num_seqs, seq_len, causal in SHAPES:
            shapes = AttentionShapes(heads, kv_heads, head_dim, dtype, max_model_len=seq_len)
            workload = PackedBinShape(num_seqs, seq_len, causal)
            calls = timed_calls(candidates(shapes, causal), shapes, workload, CPU)
            best = best_times_s(dict(calls), rounds)
            fastest_s = min(best.values())
            work = flops(heads, head_dim, num_seqs, seq_len, causal)
            dtype_name = str(dtype).removeprefix("torch.")
            for name, seconds in best.items():
                rows.append(
                    {
                        "shape": label,
                        "dtype": dtype_name,
                        "candidate": name,
                        "ms": seconds * 1e3,
                        "gflops": work / seconds / 1e9,
                        "vs_fastest": seconds / fastest_s,
                    }
                )
            harness.log(
                f"{label}, {dtype_name}: "
                + ", ".join(f"{n} {s * 1e3:.1f} ms" for n, s in best.items())
            )
    return rows


def markdown_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| shape | dtype | candidate | ms per layer | GFLOPS | time / fastest |",
        "|---|---|---|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['shape']} | {row['dtype']} | {row['candidate']} | {row['ms']:.2f} | "
            f"{row['gflops']:.1f} | {row['vs_fastest']:.2f}x |"
        )
    return "\n".join(lines)


def save_plot(rows: list[dict[str, Any]], machine: Mapping[str, Any], path: Path) -> None:
    labels = list(dict.fromkeys(f"{row['shape']}, {row['dtype']}" for row in rows))
    names = list(dict.fromkeys(row["candidate"] for row in rows))
    gflops = {(f"{row['shape']}, {row['dtype']}", row["candidate"]): row["gflops"] for row in rows}
    series = {name: [gflops.get((label, name), 0.0) for label in labels] for name in names}
    harness.save_paired_bar_chart(
        labels,
        series,
        path,
        ylabel="GFLOPS (higher is faster; 0: does not run here)",
        title=f"Prefill and encoder attention per layer, {harness.machine_summary(machine)}",
    )


if __name__ == "__main__":
    raise SystemExit(
        harness.kernel_benchmark_main(__doc__ or "", 7, RESULTS, measure, save_plot, markdown_table)
    )
