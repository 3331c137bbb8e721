"""What each of the CPU issue's targets reads from its results file (bench/cpu_targets.py):
the measured value and what it was measured from, or why there is none. Free of torch, like
cpu_targets.py."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

# A measured choice this much slower than its fastest candidate fails (bench/choice_audit.py's
# SLOWDOWN_BOUND; not imported: that module imports torch and vacpack).
AUDIT_BOUND = 1.10


@dataclass(frozen=True)
class Measured:
    value: float | None
    detail: str  # what it was measured from, or why there is no value


def system_errors(systems: Mapping[str, Any], names: tuple[str, ...]) -> str:
    errors = [f"{n}: {systems[n]['error']}" for n in names if "error" in systems.get(n, {})]
    missing = [n for n in names if n not in systems]
    return "; ".join([*errors, *(f"{n} did not run" for n in missing)]) or "no ratio in the file"


def speedup(data: dict[str, Any], ratio_key: str, names: tuple[str, str]) -> Measured:
    """A benchmark's own ratio (vacpack's throughput over the baseline's, which is the inverse
    ratio of their wall times: both count the same tokens), with both wall times."""
    systems = data.get("systems", {})
    ratio = data.get("ratios", {}).get(ratio_key)
    if ratio is None:
        return Measured(None, system_errors(systems, names))
    times = ", ".join(f"{n} {systems[n]['wall_s']:.1f} s" for n in names)
    dtype = data.get("workload", {}).get("dtype") or data.get("dtype")
    return Measured(ratio, times + (f", {dtype}" if dtype else ""))


def g1_over(baseline: str) -> Callable[[dict[str, Any]], Measured]:
    return lambda data: speedup(data, f"vacpack/{baseline}", ("vacpack", baseline))


def p1_over_vllm(data: dict[str, Any]) -> Measured:
    return speedup(data, "vacpack/vllm_cpu", ("vacpack", "vllm_cpu"))


def e1_over_vllm(data: dict[str, Any]) -> Measured:
    # One dtype per session (bf16 where the CPU has it): the first pair the file holds.
    for dtype in ("bf16", "fp32"):
        key = f"vacpack_{dtype}/vllm_{dtype}"
        if key in data.get("ratios", {}):
            return speedup(data, key, (f"vacpack_{dtype}", f"vllm_{dtype}"))
    systems = data.get("systems", {})
    ran = tuple(name for name in ("vllm_bf16", "vllm_fp32") if name in systems)
    return Measured(None, system_errors(systems, ran or ("vllm_bf16", "vllm_fp32")))


def e1_bf16_over_st(data: dict[str, Any]) -> Measured:
    return speedup(data, "vacpack_bf16/st_bf16", ("vacpack_bf16", "st_bf16"))


def shared_prompt_over_vllm(data: dict[str, Any]) -> Measured:
    summary = data.get("workloads", {}).get("shared_prompt", {})
    ratio = summary.get("vacpack_on/vllm_cpu")
    if ratio is None:
        return Measured(None, system_errors(summary, ("on", "vllm_cpu")))
    on, vllm = summary["on"]["wall_s"], summary["vllm_cpu"]["wall_s"]
    return Measured(
        ratio, f"vacpack {on:.1f} s, vllm_cpu {vllm:.1f} s, prefix caching on, {data.get('dtype')}"
    )


def decode_share_of_copy(data: dict[str, Any]) -> Measured:
    """The fastest path's KV read bandwidth over the copy bandwidth of the same run, on G1's
    decode batch with the first setting (2 threads, wall clock), as the README quotes it."""
    timings = data.get("workloads", {}).get("g1", {}).get("timings", {})
    if not timings:
        return Measured(None, "no g1 workload in the file")
    setting, timing = next(iter(timings.items()))
    bandwidth = timing["kv_bandwidth"]
    best = max(bandwidth, key=lambda path: bandwidth[path]["share_of_copy"])
    at_medians = bandwidth[best].get("share_of_median_copy_at_median")  # newer files only
    medians = "" if at_medians is None else f" ({at_medians:.0%} at the medians)"
    return Measured(
        bandwidth[best]["share_of_copy"],
        f"{best}: {bandwidth[best]['kv_read_gb_per_s']:.1f} of {timing['copy_gb_per_s']:.1f} "
        f"GB/s copied{medians}, G1's batch, {setting}, {data.get('dtype')}",
    )


def audit_worst(data: dict[str, Any]) -> Measured:
    """The chosen candidate's time over the fastest's, at the choice where it is largest."""
    rows = data.get("rows", [])
    if not rows:
        return Measured(None, "no audited choices in the file")
    worst = max(rows, key=lambda row: row["chosen_over_fastest"])
    within = sum(row["chosen_over_fastest"] <= AUDIT_BOUND for row in rows)
    furthest = (
        f"furthest: {worst['phase']} ({worst['shape_key']}), {worst['chosen']} chosen, "
        f"{worst['fastest']} fastest"
        if worst["chosen"] != worst["fastest"]
        else "every choice its fastest candidate"
    )
    return Measured(
        worst["chosen_over_fastest"],
        f"{within} of {len(rows)} choices within 10%; {furthest}; {data.get('dtype')}",
    )
