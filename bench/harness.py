"""Small helpers shared by the benchmarks: progress lines, the device and its peak memory, a
heartbeat for long calls, the machine's description, random prompts, markdown cells and
repository-relative paths; what a vacpack engine resolved to and its step timeline files; and the
bar chart every benchmark draws.

Worker subprocesses live in workers.py, the random-weight checkpoints in checkpoints.py, the matmul
peak in matmul_peak.py and process timing in process_timing.py."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from process_timing import peak_rss_bytes

# Not used here, imported for its side effect: on import vacpack asks PyTorch for huge pages for
# large host tensors (vacpack/huge_pages.py), which must happen before anything allocates, so
# every benchmark process that imports this module (orchestrators and workers) gets them.
import vacpack  # noqa: F401

HEARTBEAT_INTERVAL_S = 30.0
LABEL_HEADROOM = 1.2  # y-axis limit over the tallest bar when bars carry long labels

REPO_ROOT = Path(__file__).resolve().parent.parent


def log(message: str, prefix: str = "bench") -> None:
    """Progress goes to stderr, so stdout carries only the final table."""
    print(f"[{prefix}] {message}", file=sys.stderr, flush=True)


def peak_memory_bytes(device: str) -> int:
    """The memory that bounds a job's size: GPU memory on CUDA, resident host memory on CPU."""
    if device.startswith("cuda"):
        return int(torch.cuda.max_memory_allocated(device))
    return peak_rss_bytes()


def resolve_device(device: str) -> str:
    """Turns "auto" into cuda where a GPU is visible, else cpu."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


@contextmanager
def heartbeat(name: str, status: Callable[[], str]) -> Iterator[None]:
    """Prints a status line every HEARTBEAT_INTERVAL_S, so a long timed call shows it is alive."""
    stop = threading.Event()
    start_s = time.perf_counter()

    def beat() -> None:
        while not stop.wait(HEARTBEAT_INTERVAL_S):
            log(f"{name}: {time.perf_counter() - start_s:.0f} s in; {status()}", name)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def machine_description() -> dict[str, Any]:
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model_names = [
        ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines() if ln.startswith("model name")
    ]
    flag_lines = [ln for ln in cpuinfo.splitlines() if ln.startswith("flags")]
    flags = set(flag_lines[0].split(":", 1)[1].split()) if flag_lines else set()
    import transformers

    return {
        "cpu_model": model_names[0] if model_names else platform.processor() or "unknown",
        "cuda_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "gpu_memory_bytes": (
            torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
        ),
        "cuda_runtime_version": torch.version.cuda,
        "num_cores": os.cpu_count(),
        "num_usable_cores": len(os.sched_getaffinity(0)),
        # Which bfloat16 matmul paths oneDNN can use on this CPU.
        "bf16_cpu_flags": sorted(flags & {"avx512_bf16", "amx_bf16", "amx_tile", "avx512f"}),
        "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "transformers_version": transformers.__version__,
        "python_version": platform.python_version(),
    }


def machine_summary(machine: Mapping[str, Any], device: str = "cpu") -> str:
    """One line for a chart title: where the numbers were measured."""
    where = (
        f"{machine['cuda_device']}"
        if device.startswith("cuda") and machine.get("cuda_device")
        else f"{machine['cpu_model']}, {machine['num_usable_cores']} cores"
    )
    return f"on {where}, torch {machine['torch_version']}"


def job_report_fields(report: Any) -> dict[str, Any]:
    """What a vacpack corpus job reports about itself (`llm.corpus_runner.last_report`)."""
    return {
        "tokens_per_s": report.tokens_per_s,
        "documents_per_s": report.documents_per_s,
        "padding_overhead": report.padding_overhead,
        "peak_memory_bytes": report.peak_memory_bytes,
        "device_busy_fraction": report.device_busy_fraction,
        "bin_budget_tokens": report.bin_budget_tokens,
        "budget_source": report.budget_source,
        "num_bins": report.num_bins,
        "wait_for_bins_s": report.wait_for_bins_s,
        "elapsed_s": report.elapsed_s,
        "num_failed": report.num_failed,
    }


def random_token_prompts(
    num_prompts: int, min_prompt_len: int, max_prompt_len: int, vocab_size: int, seed: int
) -> list[list[int]]:
    """Random token-id prompts with lengths uniform in [min_prompt_len, max_prompt_len]; a pure
    function of its arguments, so every worker subprocess builds the same prompts."""
    generator = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(
        min_prompt_len, max_prompt_len + 1, (num_prompts,), generator=generator
    )
    return [
        torch.randint(0, vocab_size, (int(prompt_len),), generator=generator).tolist()
        for prompt_len in prompt_lens
    ]


def markdown_cell(text: str) -> str:
    """One line, no pipes: an error message cannot break a markdown table."""
    return " ".join(text.split()).replace("|", "/")


def repo_relative(path: Path) -> str:
    """A path as results files name it: relative to the repository where it lies inside it, so
    that committed JSON names no machine's directories."""
    resolved = path.resolve()
    return str(resolved.relative_to(REPO_ROOT)) if resolved.is_relative_to(REPO_ROOT) else str(path)


# ---------------------------------------------------------------------------- vacpack


def vacpack_engine_fields(llm: Any) -> dict[str, Any]:
    """How a vacpack engine actually runs, as resolved from its configuration: what "auto" and
    the per-device defaults turned into on this machine."""
    setup = llm.engine.setup
    return {
        "device": setup.device,
        "dtype": setup.dtype,
        "attention_backend": setup.attention_backend,
        "async_scheduling": setup.async_scheduling,
        "cuda_graphs": bool(setup.cuda_graph_batch_sizes),
        "cuda_graph_batch_sizes": list(setup.cuda_graph_batch_sizes),
        "max_num_batched_tokens": setup.max_num_batched_tokens,
        "max_num_seqs": setup.max_num_seqs,
        "kv_cache_pages": setup.kv_cache_pages,
        "kv_cache_page_tokens": setup.page_size,
        "kv_cache_keys": setup.kv_cache_keys,
        # What the model's load and the engine chose by measurement, with the timings.
        "measured_choices": [
            c.to_dict() for c in (*llm.loaded.measured_choices, *setup.measured_choices)
        ],
    }


def save_vacpack_timeline(
    timeline: Any,
    png_path: Path,
    json_path: Path,
    *,
    title: str,
    max_steps: int,
    window: str = "middle",
) -> dict[str, Any]:
    """Writes an engine's step timeline as JSON (every kept step) and as a chart of `max_steps`
    consecutive steps, few enough that single spans stay visible; returns where, and its summary."""
    # Imported only here: matplotlib takes a while to load, and only this worker draws.
    from vacpack.engine.timeline_plot import plot_timeline

    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(timeline.to_dict()) + "\n")
    plot_timeline(timeline, png_path, title=title, max_steps=max_steps, window=window)
    return {
        "timeline_summary": asdict(timeline.summary()),
        "timeline_png": repo_relative(png_path),
        "timeline_json": repo_relative(json_path),
    }


# ---------------------------------------------------------------------------- charts


def save_bar_chart(
    values: Mapping[str, float],
    plot_path: Path,
    *,
    ylabel: str,
    title: str,
    bar_labels: Sequence[str] | None = None,
    value_format: str = "%.1f",
) -> None:
    """One bar per system; each bar labelled with its value, or with `bar_labels` if given."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a benchmark machine
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    bars = axes.bar(list(values), list(values.values()), color="tab:blue")
    if bar_labels is None:
        axes.bar_label(bars, fmt=value_format)
    else:
        axes.bar_label(bars, labels=list(bar_labels))
        # Headroom above the tallest bar, so a label of two lines stays inside the axes.
        axes.set_ylim(0, max([*values.values(), 1e-9]) * LABEL_HEADROOM)
    axes.set_ylabel(ylabel)
    axes.set_title(title, fontsize=10)
    figure.tight_layout()
    plot_path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(plot_path, dpi=120)
    plt.close(figure)


def save_paired_bar_chart(
    labels: Sequence[str],
    series: Mapping[str, Sequence[float]],
    plot_path: Path,
    *,
    ylabel: str,
    title: str,
) -> None:
    """Side-by-side bars per label, one colour per series (e.g. two kernels at each shape)."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a benchmark machine
    import matplotlib.pyplot as plt

    positions = range(len(labels))
    width = 0.8 / max(1, len(series))
    figure, axes = plt.subplots(figsize=(max(8, 0.8 * len(labels)), 5.6))
    for number, (name, values) in enumerate(series.items()):
        offset = (number - (len(series) - 1) / 2) * width
        axes.bar([p + offset for p in positions], list(values), width=width, label=name)
    axes.set_xticks(list(positions), list(labels), rotation=90, fontsize=7)
    axes.set_ylabel(ylabel)
    axes.set_title(title, fontsize=9)
    axes.legend()
    figure.tight_layout()
    plot_path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(plot_path, dpi=120)
    plt.close(figure)


def kernel_benchmark_main(
    description: str,
    default_rounds: int,
    default_output: Path,
    measure: Callable[[int], list[dict[str, Any]]],
    save_plot: Callable[[list[dict[str, Any]], Mapping[str, Any], Path], None],
    markdown_table: Callable[[list[dict[str, Any]]], str],
) -> int:
    """A kernel benchmark's command line (--rounds, --output): its rows measured under
    inference mode, written as JSON at --output, its chart beside it (.png), its table
    printed."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--rounds", type=int, default=default_rounds)
    parser.add_argument("--output", type=Path, default=default_output)
    args = parser.parse_args()
    machine = machine_description()
    with torch.inference_mode():
        rows = measure(args.rounds)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"machine": machine, "rounds": args.rounds, "rows": rows}))
    plot = args.output.with_suffix(".png")
    save_plot(rows, machine, plot)
    print(f"measured {machine_summary(machine)}")
    print(markdown_table(rows))
    print(f"wrote {args.output} and {plot}")
    return 0
