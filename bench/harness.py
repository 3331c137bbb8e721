"""Measurement helpers shared by the benchmarks: timing that says how busy the machine was,
peak memory, a heartbeat for long calls, the machine's description and its bf16 matmul peak
(CUDA events on a GPU); running one system per worker subprocess within a time budget; what a
vacpack engine resolved to and its step timeline files; the bar chart every benchmark draws; and
the random-weight checkpoints with the shapes of the benchmark models."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from process_timing import (  # noqa: F401 (re-exported: the benchmarks import them from here)
    TimedSection,
    machine_busy_cpu_s,
    own_cpu_s,
    peak_rss_bytes,
    timed_section,
)

from vacpack.models.cpu_prepack import packed_linear, prepack

HEARTBEAT_INTERVAL_S = 30.0
MATMUL_WARMUP_REPS = 2
# Best of many: on a shared machine most repetitions are slowed by other work.
MATMUL_TIMED_REPS = 10
LABEL_HEADROOM = 1.2  # y-axis limit over the tallest bar when bars carry long labels

# On CUDA one F.linear at a prefill shape takes well under a millisecond: each timed repetition
# runs this many back to back between two CUDA events, so launch gaps and event resolution vanish.
MATMUL_CUDA_CALLS_PER_REP = 20

REPO_ROOT = Path(__file__).resolve().parent.parent
CHECKPOINT_CACHE_DIR = REPO_ROOT / "bench" / ".cache"
# Random weights with the exact shapes of Qwen2.5-0.5B: built once, shared by G1, O1 and P1.
QWEN2_5_0_5B_SHAPES_DIR = CHECKPOINT_CACHE_DIR / "g1-qwen2.5-0.5b-shapes"
# The same for Qwen2.5-1.5B, G1's second model size.
QWEN2_5_1_5B_SHAPES_DIR = CHECKPOINT_CACHE_DIR / "g1-qwen2.5-1.5b-shapes"


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


def best_linear_tflops(
    num_rows: int,
    in_features: int,
    out_features: int,
    generator: torch.Generator,
    device: str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, Any]:
    """Best linear-layer TFLOPS (bfloat16 unless `dtype` says) over MATMUL_TIMED_REPS runs at
    one shape.

    On a CPU both ways of running the layer are timed, `F.linear` and oneDNN on a prepacked
    weight (what vacpack runs), and the faster counts: the peak is the best this machine does.
    On CUDA the kernels run asynchronously, so a host clock around the call would time only the
    launch: each repetition is timed with CUDA events around MATMUL_CUDA_CALLS_PER_REP calls,
    after a synchronize, and read after the end event has completed.
    """
    x = torch.randn(num_rows, in_features, generator=generator).to(device, dtype)
    weight = torch.randn(out_features, in_features, generator=generator).to(device, dtype)
    flops = 2 * num_rows * in_features * out_features
    result: dict[str, Any] = {
        "shape": f"[{num_rows}, {in_features}] x [{in_features}, {out_features}]",
        "device": device,
    }
    if device.startswith("cuda"):
        for _ in range(MATMUL_WARMUP_REPS):
            torch.nn.functional.linear(x, weight)
        best_s = min(_cuda_linear_times_s(x, weight))
    else:
        best_s = min(_cpu_linear_times_s(lambda: torch.nn.functional.linear(x, weight)))
        result["f_linear_tflops"] = flops / best_s / 1e12
        packed = prepack(weight)
        if packed is not None:
            packed_s = min(_cpu_linear_times_s(lambda: packed_linear(x, packed, None)))
            result["prepacked_tflops"] = flops / packed_s / 1e12
            best_s = min(best_s, packed_s)
    return {**result, "best_s": best_s, "best_tflops": flops / best_s / 1e12}


def _cpu_linear_times_s(linear: Callable[[], torch.Tensor]) -> list[float]:
    for _ in range(MATMUL_WARMUP_REPS):
        linear()
    times_s = []
    for _ in range(MATMUL_TIMED_REPS):
        start_s = time.perf_counter()
        linear()
        times_s.append(time.perf_counter() - start_s)
    return times_s


def _cuda_linear_times_s(x: torch.Tensor, weight: torch.Tensor) -> list[float]:
    """Seconds per call, one value per repetition, from CUDA events on the current stream."""
    torch.cuda.synchronize(x.device)  # the warm-up calls and the input copies are done
    times_s = []
    for _ in range(MATMUL_TIMED_REPS):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(MATMUL_CUDA_CALLS_PER_REP):
            torch.nn.functional.linear(x, weight)
        end.record()
        end.synchronize()
        times_s.append(start.elapsed_time(end) / 1e3 / MATMUL_CUDA_CALLS_PER_REP)
    return times_s


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


# ---------------------------------------------------------------------------- workers


def worker_command(
    script: str,
    worker: str,
    worker_output: Path,
    args: Any,
    forwarded: Sequence[str],
) -> list[str]:
    """The command that reruns `script` as one worker, passing on the options named in
    `forwarded` by their argparse dest ("num_prompts" -> --num-prompts VALUE). Options that are
    None are left out (the worker's default applies); booleans become --name / --no-name."""
    command = [
        sys.executable, str(Path(script).resolve()),
        "--worker", worker, "--worker-output", str(worker_output),
    ]  # fmt: skip
    for dest in forwarded:
        value = getattr(args, dest)
        option = dest.replace("_", "-")
        if isinstance(value, bool):
            command.append(f"--{option}" if value else f"--no-{option}")
        elif value is not None:
            command += [f"--{option}", str(value)]
    return command


def run_worker(
    build_command: Callable[[Path], list[str]],
    name: str,
    log_prefix: str,
    timeout_s: float | None = None,
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Runs one worker subprocess, which writes its result as JSON to the path it is given.

    One process per system, so one system's memory never slows the next and each gets its own
    peak RSS. A worker that dies without a result, or runs past `timeout_s` (then it is killed,
    so that one slow system cannot cost the others' results), comes back as {"error": ...}.
    `env` replaces the worker's environment (default: this process's).
    """
    with tempfile.TemporaryDirectory(prefix=f"{log_prefix}-worker-") as tmp_dir:
        worker_output = Path(tmp_dir) / "result.json"
        start_s = time.perf_counter()
        try:
            # stderr is inherited, so the worker's progress lines show up live.
            completed = subprocess.run(
                build_command(worker_output), check=False, timeout=timeout_s, env=env
            )
        except subprocess.TimeoutExpired:
            log(f"{name}: worker killed after {timeout_s:.0f} s", log_prefix)
            return {"error": f"worker ran past its {timeout_s:.0f} s limit and was killed"}
        elapsed_s = time.perf_counter() - start_s
        if not worker_output.exists():
            return {"error": f"worker exited with code {completed.returncode} and wrote no result"}
        result: dict[str, Any] = json.loads(worker_output.read_text())
    log(
        f"{name}: worker done in {elapsed_s:.0f} s"
        + (f"; {result['error']}" if "error" in result else ""),
        log_prefix,
    )
    return result


# A worker given less time than this would only be killed before it measures anything.
MIN_WORKER_TIME_S = 20.0


@dataclass
class RunBudget:
    """A whole run's time budget, so that its results file is written even when systems run
    long: each worker may use at most what is left of it (and its own limit, if any)."""

    budget_s: float | None
    start_s: float = field(default_factory=time.perf_counter)

    def worker_timeout_s(self, per_worker_s: float | None) -> float | None:
        """The next worker's time limit; None when neither limit is set."""
        limits = [per_worker_s] if per_worker_s is not None else []
        if self.budget_s is not None:
            limits.append(self.budget_s - (time.perf_counter() - self.start_s))
        return min(limits) if limits else None


def run_worker_within(
    budget: RunBudget,
    per_worker_s: float | None,
    build_command: Callable[[Path], list[str]],
    name: str,
    log_prefix: str,
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """run_worker under what is left of the run's budget; a worker for which too little is left
    is not started, and says so in its result."""
    timeout_s = budget.worker_timeout_s(per_worker_s)
    if timeout_s is not None and timeout_s < MIN_WORKER_TIME_S:
        log(f"{name}: not started, {max(timeout_s, 0):.0f} s of the time budget left", log_prefix)
        return {"error": "not started: the run's time budget was spent"}
    return run_worker(build_command, name, log_prefix, timeout_s=timeout_s, env=env)


def run_catching_errors(run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """A worker's measurement; an exception becomes {"error": ...}, so one system failing never
    loses the others' results."""
    try:
        return run()
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}"}


def save_worker_result(result: dict[str, Any], worker_output: Path) -> None:
    """Adds what every worker reports about its own process, then writes the result file."""
    result["peak_rss_bytes"] = peak_rss_bytes()
    result["torch_threads"] = torch.get_num_threads()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # On a GPU the memory that bounds a job is the device's, not the host's.
        result["peak_gpu_memory_bytes"] = int(torch.cuda.max_memory_allocated())
    worker_output.write_text(json.dumps(result))


def publish_results(
    results: dict[str, Any],
    output_path: Path,
    plot_path: Path,
    save_plot: Callable[[dict[str, Any], Path], None],
    table: str,
    log_prefix: str,
) -> None:
    """The end of every benchmark run: the JSON file, the chart, and the table on stdout."""
    output_path.parent.mkdir(parents=True, exist_ok=True)
    output_path.write_text(json.dumps(results, indent=2) + "\n")
    save_plot(results, plot_path)
    log(f"wrote {output_path} and {plot_path}", log_prefix)
    print(table)


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


# ---------------------------------------------------------------------------- checkpoints


def qwen2_5_1_5b_shapes() -> dict[str, Any]:
    """Config fields giving the exact shapes of Qwen2.5-1.5B, for random-weight benchmarks."""
    return {
        "hidden_size": 1536,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "intermediate_size": 8960,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "use_sliding_window": False,
    }


# Where each named shape's random-weight checkpoint is built by default.
MODEL_SHAPE_DIRS: dict[str, Path] = {
    "qwen2.5-0.5b": QWEN2_5_0_5B_SHAPES_DIR,
    "qwen2.5-1.5b": QWEN2_5_1_5B_SHAPES_DIR,
}


def model_shapes(shape: str) -> dict[str, Any]:
    """The config fields of a named model shape (a key of MODEL_SHAPE_DIRS)."""
    if shape == "qwen2.5-0.5b":
        from vacpack.testing.tiny_models import qwen2_5_0_5b_shapes

        return qwen2_5_0_5b_shapes()
    if shape == "qwen2.5-1.5b":
        return qwen2_5_1_5b_shapes()
    raise ValueError(f"unknown model shape {shape!r}; known: {', '.join(MODEL_SHAPE_DIRS)}")


def ensure_shapes_checkpoint(shape: str, model_dir: Path, log_prefix: str) -> Path:
    """Builds the random-weight checkpoint of a named shape once; later runs reuse it."""
    if (model_dir / "config.json").exists():
        return model_dir
    from vacpack.testing.tiny_models import build_random_checkpoint

    config = model_shapes(shape)
    log(f"building the random-weight {shape}-shaped checkpoint in {model_dir}", log_prefix)
    # Built beside the target and renamed into place, so an interrupted build never leaves a
    # half-written directory that a later run would take for a finished one.
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    partial_dir = model_dir.with_name(f"{model_dir.name}.partial-{os.getpid()}")
    build_random_checkpoint(config, "qwen2", partial_dir)
    partial_dir.rename(model_dir)
    return model_dir


def ensure_qwen2_5_0_5b_shapes_checkpoint(model_dir: Path, log_prefix: str) -> Path:
    """Builds the random-weight Qwen2.5-0.5B-shaped checkpoint once; later runs reuse it."""
    return ensure_shapes_checkpoint("qwen2.5-0.5b", model_dir, log_prefix)


def ensure_qwen2_5_1_5b_shapes_checkpoint(model_dir: Path, log_prefix: str) -> Path:
    """Builds the random-weight Qwen2.5-1.5B-shaped checkpoint once; later runs reuse it."""
    return ensure_shapes_checkpoint("qwen2.5-1.5b", model_dir, log_prefix)
