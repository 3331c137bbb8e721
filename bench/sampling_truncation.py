"""Random sampling with top-k, top-p and min-p on a CPU: the engine's sampler on a 64-row
decode step of Qwen2.5-0.5B's 151,936-token vocabulary, its truncation as it is (candidates
first, vacpack/engine/truncation.py) against every row sorted whole (what it did before, and
does on a GPU) and against min-p through a softmax. Logits peaked as a trained model's (a
few dozen tokens ~12 nats above the rest) and flat (random weights' or a high temperature's).
Interleaved, best of --rounds; JSON, a chart and a markdown table.

    python bench/sampling_truncation.py [--rounds 7] [--output PATH.json]
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import harness
import torch
from linear_kernels import best_times_s

from vacpack.engine import sampler as sampler_module
from vacpack.engine import truncation
from vacpack.engine.sampler import Sampler, SamplingRow
from vacpack.sampling import SamplingParams

RESULTS = harness.REPO_ROOT / "bench" / "results" / "sampling_truncation_cpu.json"
VOCAB_SIZE = 151_936
NUM_ROWS = 64
SETTINGS = {
    "temperature 0.7": SamplingParams(temperature=0.7),
    "top_p 0.9": SamplingParams(temperature=0.7, top_p=0.9),
    "top_k 50": SamplingParams(temperature=0.7, top_k=50),
    "top_k 40, top_p 0.95": SamplingParams(top_k=40, top_p=0.95),
    "min_p 0.05": SamplingParams(temperature=0.7, min_p=0.05),
}


def sorted_whole(logits, top_k, top_p, row_top_k, row_top_p):  # type: ignore[no-untyped-def]
    return truncation._sorted_top_k_top_p(logits, top_k, top_p)


def min_p_by_softmax(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def logits_of(kind: str, generator: torch.Generator) -> torch.Tensor:
    logits = torch.randn(NUM_ROWS, VOCAB_SIZE, generator=generator) * 2
    if kind == "peaked":
        logits[:, :40] += 12 + torch.randn(NUM_ROWS, 40, generator=generator)
    return logits


def measure(rounds: int) -> list[dict[str, Any]]:
    generator = torch.Generator().manual_seed(0)
    sampler = Sampler(VOCAB_SIZE, torch.device("cpu"), seed=0)
    results = []
    for kind in ("peaked", "flat"):
        logits = logits_of(kind, generator)
        for setting, params in SETTINGS.items():
            rows = [SamplingRow(params, (), (), None, frozenset()) for _ in range(NUM_ROWS)]

            def current(rows: list[SamplingRow] = rows, logits: torch.Tensor = logits) -> object:
                return sampler(logits, rows)

            def before(rows: list[SamplingRow] = rows, logits: torch.Tensor = logits) -> object:
                real = (sampler_module.apply_top_k_top_p, sampler_module.apply_min_p)
                sampler_module.apply_top_k_top_p = sorted_whole
                sampler_module.apply_min_p = min_p_by_softmax
                try:
                    return sampler(logits, rows)
                finally:
                    sampler_module.apply_top_k_top_p, sampler_module.apply_min_p = real

            best = best_times_s({"before": before, "now": current}, rounds)
            row = {
                "logits": kind,
                "setting": setting,
                "best_ms": {name: time_s * 1e3 for name, time_s in best.items()},
                "speedup": best["before"] / best["now"],
            }
            harness.log(
                f"{kind}, {setting}: before {row['best_ms']['before']:.1f} ms, now "
                f"{row['best_ms']['now']:.1f} ms ({row['speedup']:.1f}x)"
            )
            results.append(row)
    return results


def markdown_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| logits | sampling | rows sorted whole, min-p by softmax | now | speed-up |",
        "|---|---|---:|---:|---:|",
    ]
    for r in rows:
        ms = r["best_ms"]
        lines.append(
            f"| {r['logits']} | {r['setting']} | {ms['before']:.1f} ms | {ms['now']:.1f} ms | "
            f"{r['speedup']:.1f}x |"
        )
    return "\n".join(lines)


def save_plot(rows: list[dict[str, Any]], machine: Mapping[str, Any], path: Path) -> None:
    harness.save_paired_bar_chart(
        [f"{r['setting']}\n{r['logits']}" for r in rows],
        {
            "rows sorted whole, min-p by softmax": [r["best_ms"]["before"] for r in rows],
            "candidates first, min-p as a logit threshold": [r["best_ms"]["now"] for r in rows],
        },
        path,
        ylabel=f"ms per {NUM_ROWS}-row sampling step (best of the rounds)",
        title=f"Sampling, {VOCAB_SIZE:,}-token vocabulary, {harness.machine_summary(machine)}",
    )


def main() -> int:
    return harness.kernel_benchmark_main(
        __doc__.split("\n\n")[0], 7, RESULTS, measure, save_plot, markdown_table
    )


if __name__ == "__main__":
    raise SystemExit(main())
