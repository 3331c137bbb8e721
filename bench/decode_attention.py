"""Decode attention alone: the SDPA decode path this backend had before, against the paged
matmul path, cascade attention, SDPA over gathered pages, the portable paged-decode C kernel
(any CPU) and the AVX512-BF16 C paged kernel, in ms per decode step of a 24-layer model, on CPU.

Three decode batches with Qwen2.5-0.5B's attention shapes (14 query heads, 2 KV heads, head_dim
64, bf16 where the CPU has it, else float32 (`--dtype`), 24 layers, 16-token pages), each
layer with its own KV cache so that a step reads its keys and values from memory, not from a
warm cache:

- g1: 64 sequences with contexts uniform in 32..1024 plus 0..128 generated tokens, the middle of
  G1's decode (bench/g1_generation.py).
- shared_prefix: 128 sequences sharing a 1,024-token prefix (the same 64 physical pages, as
  prefix caching leaves them), each with its own 32..128 prompt tokens plus 0..64 generated, the
  middle of bench/prefix_sharing.py's decode.
- long_decodes: two sequences of 8,000 and 6,000 prompt tokens plus 64 generated: four tasks (a
  sequence and KV head each), too few for the threads, where the C kernel splits each decode's
  keys over several tasks (split-K).

The paths run interleaved in one process, round after round, and the best round counts: other
processes on a small shared machine slow a round, never speed it up. Each workload is timed
twice: with 2 threads by the wall clock (what a step costs on a quiet machine), and with 1
thread by this process's CPU time, which other processes' load inflates far less. Host time to
build a step's metadata is reported apart.

Each path's achieved KV-cache read bandwidth is the step's KV bytes (every distinct cached
token's keys and values in every layer, read once: the memory floor; a shared prefix counts
once) over its best time, set against a copy bandwidth measured in the same rounds with the
same threads and clock: a COPY_BYTES tensor copied into another, timed among the paths in
every round, best of the rounds, counting the bytes read and the bytes written (STREAM's
convention). Also against the host's read-only bandwidth, the same tensor summed: what a
kernel that only reads memory can reach (on the Zen 3, two threads read 22-25 GB/s alone
where the copy figure moved between 24 and 36 GB/s). Each path's median step against the
median copy is reported too: the host under its usual load.

`--sweep` also times a cascade for every group against the plain paged path, for 64 sequences
in groups of 2..64 sharing 8..64 pages: the measurement behind DEFAULT_CASCADE_POLICY.

`--bf16-kv-cache` (float32) also times the C kernels' paths over the same step with its cache
rounded to bfloat16 (paths named "..., bf16 KV cache"), interleaved with the rest: float32
arithmetic on a bfloat16 model, whose cache the engine keeps in bfloat16 (kv_cache_dtype auto).
Their bandwidth counts the bfloat16 cache's bytes; their difference from the reference is the
rounding's.

    python bench/decode_attention.py --sweep    # about 10 minutes on a 2-core CPU
    python bench/decode_attention.py --rounds 2 --layers 4 --output bench/results/tmp/da.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import harness
import process_timing
import torch
from decode_attention_paths import (
    C_KERNEL,
    PORTABLE_KERNEL,
    legacy_metadata,
    legacy_slot_mapping,
    step_runners,
)
from decode_attention_report import (
    bandwidth,
    kv_bytes_per_step,
    print_table,
    save_plots,
    write_results,
)
from decode_attention_workload import (
    CPU,
    PAGE_SIZE,
    DecodeBatch,
    g1_batch,
    long_decodes_batch,
    make_batch,
    make_step,
    shared_prefix_batch,
)

from vacpack.attention.cascade import CascadePolicy
from vacpack.attention.cpu_kernel_backend import CpuKernelBackend
from vacpack.attention.torch_sdpa import TorchSdpaBackend

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUTPUT_PATH = REPO_ROOT / "bench" / "results" / "decode_attention_cpu.json"

# The copy that measures the machine's memory bandwidth: far larger than any CPU's caches.
COPY_BYTES = 512 * 2**20
BF16_KV = "bf16 KV cache"  # the suffix of --bf16-kv-cache's paths
COPY_PROBE, READ_PROBE = "memory copy", "memory read"  # bandwidth_probes's names
# wall: elapsed time, what a step costs. cpu: this process's CPU time, which other processes
# on a shared machine inflate far less; meaningful with one thread (torch's threads spin while
# they wait for each other, which counts as CPU time).
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


@dataclass(frozen=True)
class Setting:
    name: str
    threads: int
    clock: str  # a key of CLOCKS


SETTINGS = (
    Setting("2 threads, wall clock", 2, "wall"),
    Setting("1 thread, process CPU time", 1, "cpu"),
)
SWEEP_SETTING = SETTINGS[1]

# ---------------------------------------------------------------------------- timing


def interleaved_best_ms(
    runners: dict[str, Callable[[], Any]], rounds: int, clock: Callable[[], float]
) -> dict[str, dict[str, float]]:
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(rounds):
        for name, run in runners.items():
            start = clock()
            run()
            times[name].append((clock() - start) * 1e3)
    return {
        name: {"best_ms": min(ms), "median_ms": statistics.median(ms)} for name, ms in times.items()
    }


def best_call_s(call: Callable[[], object], rounds: int, clock: Callable[[], float]) -> float:
    """`call`'s best time over `rounds`, after one untimed call (pages mapped, caches warm)."""
    call()
    best_s = float("inf")
    for _ in range(rounds):
        start = clock()
        call()
        best_s = min(best_s, clock() - start)
    return best_s


def bandwidth_probes() -> dict[str, Callable[[], object]]:
    """The host's memory bandwidth measurements, as calls timed among the paths' rounds: a
    large copy (STREAM's convention: bytes read plus bytes written) and a large sum (read
    only). Timed in the same rounds as the kernels, each best comes from the same stretch of
    the host's load as theirs: measured after them, a quieter or busier minute moved the
    kernels' share of it by several points (55% and 57% for one kernel, an hour apart)."""
    source = torch.ones(COPY_BYTES // 4, dtype=torch.float32)
    target = torch.empty_like(source)
    return {COPY_PROBE: lambda: target.copy_(source), READ_PROBE: source.sum}


def probe_gb_per_s(ms: dict[str, dict[str, float]]) -> dict[str, float]:
    """Copy and read bandwidth (GB/s) from the probes' best and median times, which leave
    `ms`. The median is the host under its usual load: on this project's shared 2-core hosts
    the best copy now and then catches a burst of the memory bus to itself (45-56 GB/s where
    the copies around it read 30-35), which the kernels' 24-layer steps rarely do."""
    copy, read = ms.pop(COPY_PROBE), ms.pop(READ_PROBE)
    return {
        "copy_gb_per_s": 2 * COPY_BYTES / copy["best_ms"] / 1e6,
        "read_gb_per_s": COPY_BYTES / read["best_ms"] / 1e6,
        "copy_gb_per_s_median": 2 * COPY_BYTES / copy["median_ms"] / 1e6,
        "read_gb_per_s_median": COPY_BYTES / read["median_ms"] / 1e6,
    }


def metadata_ms(batch: DecodeBatch, rounds: int) -> dict[str, float]:
    """Best host time to build a step's metadata, old path and new."""
    result = {}
    for name, build in (
        ("sdpa (before)", lambda: (legacy_slot_mapping(batch), legacy_metadata(batch))),
        ("paged matmul + cascade", lambda: TorchSdpaBackend().build_metadata(batch.layout, CPU)),
        (C_KERNEL, lambda: CpuKernelBackend().build_metadata(batch.layout, CPU)),
    ):
        result[name] = best_call_s(build, rounds, time.perf_counter) * 1e3
    return result


def run_workload(
    batch: DecodeBatch, args: argparse.Namespace, generator: torch.Generator
) -> dict[str, Any]:
    step = make_step(batch, args.layers, generator, args.dtype)
    runners = step_runners(batch, step)
    kv_bytes = dict.fromkeys(runners, kv_bytes_per_step(batch, args.layers, args.dtype))
    if args.bf16_kv_cache:
        narrow = step.with_cache_in(torch.bfloat16)
        narrow_bytes = kv_bytes_per_step(batch, args.layers, torch.bfloat16)
        for name, run in step_runners(batch, narrow).items():
            if name.startswith((PORTABLE_KERNEL, C_KERNEL)):
                runners[f"{name}, {BF16_KV}"] = run
                kv_bytes[f"{name}, {BF16_KV}"] = narrow_bytes
    outputs = {name: run()[0].float() for name, run in runners.items()}  # also warms up
    reference = outputs["sdpa (before)"]
    timings = {}
    for setting in SETTINGS:
        torch.set_num_threads(setting.threads)
        clock = CLOCKS[setting.clock]
        with process_timing.timed_section() as section:
            ms = interleaved_best_ms({**runners, **bandwidth_probes()}, args.rounds, clock)
        probes = probe_gb_per_s(ms)
        best_before = ms["sdpa (before)"]["best_ms"]
        timings[setting.name] = {
            "threads": setting.threads,
            "clock": setting.clock,
            "ms_per_step": ms,
            "speedup_vs_before": {name: best_before / t["best_ms"] for name, t in ms.items()},
            **probes,
            "kv_bandwidth": bandwidth(kv_bytes, ms, probes),
            **section.fields(),
        }
    return {
        "num_seqs": len(batch.context_lens),
        "num_context_tokens": sum(batch.context_lens),
        "kv_bytes_per_step": kv_bytes,
        "num_layers": args.layers,
        "timings": timings,
        "max_abs_diff_vs_before": {
            name: (out - reference).abs().max().item() for name, out in outputs.items()
        },
        "metadata_build_ms": metadata_ms(batch, args.rounds),
    }


def run_sweep(args: argparse.Namespace, generator: torch.Generator) -> list[dict[str, Any]]:
    """64 sequences in groups of group_seqs sharing prefix_pages pages, each with 32..128 own
    tokens: a cascade for every group against the plain paged path, per layer."""
    always = CascadePolicy(min_prefix_tokens=1, min_saved_tokens=1)
    rows = []
    num_seqs = 64
    for group_seqs in (2, 4, 8, 64):
        for prefix_pages in (8, 16, 32, 64):
            prefix_ids = [i // group_seqs for i in range(num_seqs)]
            prompts = torch.randint(32, 129, (num_seqs,), generator=generator).tolist()
            batch = make_batch(prefix_ids, prefix_pages * PAGE_SIZE, prompts, [0] * num_seqs)
            step = make_step(batch, args.sweep_layers, generator, args.dtype)
            runners = step_runners(batch, step, always)
            # The sweep behind the policy times the portable matmul paths alone.
            runners = {n: r for n, r in runners.items() if n.startswith("paged matmul")}
            timings = interleaved_best_ms(runners, args.rounds, CLOCKS[SWEEP_SETTING.clock])
            plain = timings["paged matmul"]["best_ms"] / args.sweep_layers
            cascade = timings["paged matmul + cascade"]["best_ms"] / args.sweep_layers
            rows.append(
                {
                    "group_seqs": group_seqs,
                    "prefix_pages": prefix_pages,
                    "saved_tokens_per_group": (group_seqs - 1) * prefix_pages * PAGE_SIZE,
                    "plain_ms_per_layer": plain,
                    "cascade_ms_per_layer": cascade,
                    "cascade_saves_ms_per_group_and_layer": (plain - cascade)
                    * group_seqs
                    / num_seqs,
                }
            )
            harness.log(f"sweep {rows[-1]}", "decode_attention")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--sweep-layers", type=int, default=4)
    parser.add_argument(
        "--dtype",
        choices=["auto", "bfloat16", "float32"],
        default="auto",
        help="the KV cache's dtype; auto: bfloat16 where oneDNN has bf16 kernels for this CPU "
        "(AVX-512 or AMX), else float32, whose bf16 would be emulated",
    )
    parser.add_argument(
        "--bf16-kv-cache",
        action="store_true",
        help="float32: also time the C kernels over a bf16 copy of the cache (see above)",
    )
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT_PATH)
    args = parser.parse_args()
    if args.dtype == "auto":
        has_bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
        args.dtype = "bfloat16" if has_bf16 else "float32"
    args.dtype = getattr(torch, args.dtype)
    if args.bf16_kv_cache and args.dtype != torch.float32:
        parser.error("--bf16-kv-cache goes with float32 queries (--dtype float32)")
    generator = torch.Generator().manual_seed(0)
    results: dict[str, Any] = {
        "machine": harness.machine_description(),
        "dtype": str(args.dtype).removeprefix("torch."),
        "workloads": {},
    }
    batches = {
        "g1": lambda: g1_batch(generator),
        "shared_prefix": lambda: shared_prefix_batch(generator),
        "long_decodes": long_decodes_batch,
    }
    for name, make in batches.items():
        harness.log(f"{name}: timing", "decode_attention")
        results["workloads"][name] = run_workload(make(), args, generator)
    if args.sweep:
        torch.set_num_threads(SWEEP_SETTING.threads)
        results["cascade_sweep"] = {
            "threads": SWEEP_SETTING.threads,
            "clock": SWEEP_SETTING.clock,
            "num_layers": args.sweep_layers,
            "rows": run_sweep(args, generator),
        }
    write_results(results, args.output)
    print_table(results)
    for plot in save_plots(results, args.output):
        print(f"wrote {plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
