"""Token logprobs from CPU logits: the C kernel (cpu_kernels/token_logprobs.c) against the
PyTorch ops it replaced, at the LM head's pass sizes on Qwen2.5-0.5B's 151,936-token
vocabulary. Corpus scoring (a target's logprob, with and without the greedy argmax; the
PyTorch side a log-softmax on 32-row slices, as score_tokens ran it), prompt logprobs (256
rows, no top-k and a top-5) and a 64-row decode step's top-5 logprobs (the PyTorch side a
whole log-softmax and gather_logprobs). Interleaved, best of --rounds; JSON, a chart and a
markdown table.

    python bench/scoring_kernels.py [--rounds 11] [--output bench/results/scoring_kernels_cpu.json]
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import harness
import torch
from linear_kernels import best_times_s

from vacpack.corpus.token_logprobs import CPU_SOFTMAX_ROWS
from vacpack.cpu_kernels.token_logprobs import token_logprobs, token_logprobs_supported
from vacpack.engine.logprob_gather import gather_logprobs, logprobs_of

RESULTS = harness.REPO_ROOT / "bench" / "results" / "scoring_kernels_cpu.json"
VOCAB_SIZE = 151_936


def sliced_log_softmax(logits: torch.Tensor, targets: torch.Tensor, with_argmax: bool) -> None:
    """score_tokens' PyTorch path: float32 log-softmax, gather and argmax on cache-sized slices."""
    for start in range(0, logits.shape[0], CPU_SOFTMAX_ROWS):
        part = logits[start : start + CPU_SOFTMAX_ROWS].float()
        torch.log_softmax(part, dim=-1).gather(
            1, targets[start : start + CPU_SOFTMAX_ROWS].unsqueeze(1)
        )
        if with_argmax:
            part.argmax(dim=-1)


def cases() -> list[tuple[str, int, Callable[..., object], Callable[..., object]]]:
    """(case, rows, PyTorch call, kernel call), each call taking (logits, targets)."""
    return [
        (
            "scoring",
            256,
            lambda x, t: sliced_log_softmax(x, t, False),
            lambda x, t: token_logprobs(x, t),
        ),
        (
            "scoring + argmax",
            256,
            lambda x, t: sliced_log_softmax(x, t, True),
            lambda x, t: token_logprobs(x, t, with_argmax=True),
        ),
        *(
            (
                f"{what}, top-{k}",
                rows,
                lambda x, t, k=k: gather_logprobs(torch.log_softmax(x.float(), dim=-1), t, k),
                lambda x, t, k=k: logprobs_of(x, t, k),
            )
            for what, rows, k in (("prompt", 256, 0), ("prompt", 256, 5), ("decode", 64, 5))
        ),
    ]


def measure(rounds: int) -> list[dict[str, Any]]:
    generator = torch.Generator().manual_seed(0)
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        for case, num_rows, torch_call, kernel_call in cases():
            logits = (torch.randn(num_rows, VOCAB_SIZE, generator=generator) * 3).to(dtype)
            targets = torch.randint(0, VOCAB_SIZE, (num_rows,), generator=generator)
            best = best_times_s(
                {
                    "pytorch": lambda c=torch_call, x=logits, t=targets: c(x, t),
                    "kernel": lambda c=kernel_call, x=logits, t=targets: c(x, t),
                },
                rounds,
            )
            row = {
                "case": case,
                "dtype": str(dtype).removeprefix("torch."),
                "rows": num_rows,
                "best_ms": {name: time_s * 1e3 for name, time_s in best.items()},
                "kernel_speedup": best["pytorch"] / best["kernel"],
            }
            harness.log(
                f"{case}, {row['dtype']}, {num_rows} rows: PyTorch {row['best_ms']['pytorch']:.1f} "
                f"ms, kernel {row['best_ms']['kernel']:.1f} ms ({row['kernel_speedup']:.1f}x)"
            )
            results.append(row)
    return results


def markdown_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| case | dtype | rows | PyTorch ms | kernel ms | kernel speed-up |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        ms = r["best_ms"]
        lines.append(
            f"| {r['case']} | {r['dtype']} | {r['rows']} | {ms['pytorch']:.1f} | "
            f"{ms['kernel']:.1f} | {r['kernel_speedup']:.1f}x |"
        )
    return "\n".join(lines)


def save_plot(rows: list[dict[str, Any]], machine: Mapping[str, Any], path: Path) -> None:
    harness.save_paired_bar_chart(
        [f"{r['case']}\n{r['dtype']}, {r['rows']} rows" for r in rows],
        {
            "PyTorch ops": [r["best_ms"]["pytorch"] for r in rows],
            "C kernel": [r["best_ms"]["kernel"] for r in rows],
        },
        path,
        ylabel="ms per call (best of the rounds)",
        title=f"Token logprobs, {VOCAB_SIZE:,}-token vocabulary, "
        f"{harness.machine_summary(machine)}",
    )


def main() -> int:
    if not token_logprobs_supported(torch.zeros(1, 1)):
        raise SystemExit("the token_logprobs kernel does not build here (no C compiler)")
    return harness.kernel_benchmark_main(
        __doc__.split("\n\n")[0], 11, RESULTS, measure, save_plot, markdown_table
    )


if __name__ == "__main__":
    raise SystemExit(main())
