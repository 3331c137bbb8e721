"""Running one system per worker subprocess within a time budget: the worker's command line,
running it (killed past its time limit), the whole run's budget, turning a worker's exception into
an error result, the result file every worker writes, and publishing a run's results."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from harness import log
from process_timing import peak_rss_bytes


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
    plot_path: Path | None,
    save_plot: Callable[[dict[str, Any], Path], None],
    table: str,
    log_prefix: str,
) -> None:
    """The end of every benchmark run: the JSON file, the chart (None: beside the JSON, as
    .png, so that a run with its own --output never overwrites a committed chart), and the
    table on stdout."""
    plot_path = plot_path or output_path.with_suffix(".png")
    output_path.parent.mkdir(parents=True, exist_ok=True)
    output_path.write_text(json.dumps(results, indent=2) + "\n")
    save_plot(results, plot_path)
    log(f"wrote {output_path} and {plot_path}", log_prefix)
    print(table)
