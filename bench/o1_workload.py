"""O1's workload: the configurations (async scheduling off and on, CUDA graphs on and off), the
workload sizes run by default on CUDA and on a CPU, the prompt seeds, the targets, and the small
helpers every part reads them through. Shared by the orchestrator, its workers and the report."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import harness

PROMPT_SEED = 0
# The warm-up's prompts come from another seed, so the prefix cache gives the timed run nothing.
WARMUP_PROMPT_SEED = 1


@dataclass(frozen=True)
class Workload:
    num_prompts: int
    min_prompt_len: int
    max_prompt_len: int
    max_tokens: int  # output tokens per request


# The size, run by default on CUDA.
FULL_WORKLOAD = Workload(num_prompts=256, min_prompt_len=32, max_prompt_len=1024, max_tokens=512)
# Default on a CPU: about a minute per configuration on 2 cores instead of hours.
CPU_SCALED_WORKLOAD = Workload(num_prompts=32, min_prompt_len=32, max_prompt_len=256, max_tokens=32)


@dataclass(frozen=True)
class OverlapConfig:
    async_scheduling: bool
    cuda_graphs: bool  # asked for; only CUDA has graphs, so on a CPU this changes nothing
    description: str


CONFIGS: dict[str, OverlapConfig] = {
    "overlap_off": OverlapConfig(False, True, "async scheduling off"),
    "overlap_on": OverlapConfig(True, True, "async scheduling on"),
    "overlap_on_no_graphs": OverlapConfig(True, False, "async scheduling on, CUDA graphs off"),
}
DEFAULT_CONFIGS = {
    "cuda": ("overlap_off", "overlap_on", "overlap_on_no_graphs"),
    "cpu": ("overlap_off", "overlap_on"),
}
REFERENCE_CONFIG = "overlap_off"  # greedy outputs are compared against this one's

# The targets for the full-size run on CUDA.
TARGET_DEVICE_BUSY_FRACTION = 0.99
TARGET_OVERLAP_SPEEDUP = 1.15

RESULTS_DIR = harness.REPO_ROOT / "bench" / "results"


def log(message: str) -> None:
    harness.log(message, "o1")


def read_model_config(model_dir: Path) -> dict[str, Any]:
    return json.loads((model_dir / "config.json").read_text())


def workload_of(args: argparse.Namespace) -> Workload:
    return Workload(args.num_prompts, args.min_prompt_len, args.max_prompt_len, args.max_tokens)


def scale_name(workload: Workload) -> str:
    if workload == FULL_WORKLOAD:
        return "full size"
    if workload == CPU_SCALED_WORKLOAD:
        return "scaled down for CPU"
    return "custom size"
