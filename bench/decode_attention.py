"""Decode attention alone: the SDPA decode path this backend had before, against the paged
matmul path, cascade attention, SDPA over gathered pages, the portable paged-decode C kernel
(any CPU) and the AVX512-BF16 C paged kernel, in ms per decode step of a 24-layer model, on CPU.

Two decode batches with Qwen2.5-0.5B's attention shapes (14 query heads, 2 KV heads, head_dim
64, bf16 where the CPU has it, else float32 (`--dtype`), 24 layers, 16-token pages), each
layer with its own KV cache so that a step reads its keys and values from memory, not from a
warm cache:

- g1: 64 sequences with contexts uniform in 32..1024 plus 0..128 generated tokens, the middle of
  G1's decode (bench/g1_generation.py).
- shared_prefix: 128 sequences sharing a 1,024-token prefix (the same 64 physical pages, as
  prefix caching leaves them), each with its own 32..128 prompt tokens plus 0..64 generated, the
  middle of bench/prefix_sharing.py's decode.

The paths run interleaved in one process, round after round, and the best round counts: other
processes on a small shared machine slow a round, never speed it up. Each workload is timed
twice: with 2 threads by the wall clock (what a step costs on a quiet machine), and with 1
thread by this process's CPU time, which other processes' load inflates far less. Host time to
build a step's metadata is reported apart.

Each path's achieved KV-cache read bandwidth is the step's KV bytes (every distinct cached
token's keys and values in every layer, read once: the memory floor; a shared prefix counts
once) over its best time, set against a copy bandwidth measured in the same run with the same
threads and clock: a COPY_BYTES tensor copied into another, best of the rounds, counting the
bytes read and the bytes written (STREAM's convention).

`--sweep` also times a cascade for every group against the plain paged path, for 64 sequences
in groups of 2..64 sharing 8..64 pages: the measurement behind DEFAULT_CASCADE_POLICY.

    python bench/decode_attention.py --sweep    # about 10 minutes on a 2-core CPU
    python bench/decode_attention.py --rounds 2 --layers 4 --output bench/results/tmp/da.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import harness
import torch
import torch.nn.functional as F

from vacpack.attention.backend import AttentionBackend, BatchLayout
from vacpack.attention.cascade import DEFAULT_CASCADE_POLICY, CascadePolicy
from vacpack.attention.cpu_kernel_backend import CpuKernelBackend
from vacpack.attention.torch_sdpa import TorchSdpaBackend
from vacpack.cpu_kernels import varlen_attention_supported
from vacpack.cpu_kernels.paged_decode import paged_decode_supported
from vacpack.kvcache.paged_cache import KVLayer

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUTPUT_PATH = REPO_ROOT / "bench" / "results" / "decode_attention_cpu.json"

NUM_HEADS = 14
NUM_KV_HEADS = 2
HEAD_DIM = 64
PAGE_SIZE = 16
CPU = torch.device("cpu")
C_KERNEL = "C paged kernel"  # vacpack/cpu_kernels, where this CPU has AVX512-BF16
PORTABLE_KERNEL = "portable C decode kernel"  # cpu_kernels/paged_decode.c, any CPU
# The copy that measures the machine's memory bandwidth: far larger than any CPU's caches.
COPY_BYTES = 512 * 2**20
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


@dataclass(frozen=True)
class DecodeBatch:
    page_tables: list[list[int]]
    context_lens: list[int]
    num_pages: int

    @property
    def layout(self) -> BatchLayout:
        num_seqs = len(self.context_lens)
        return BatchLayout([1] * num_seqs, self.context_lens, self.page_tables, PAGE_SIZE)


def _pages_for(num_tokens: int) -> int:
    return -(-num_tokens // PAGE_SIZE)


def make_batch(
    prefix_ids: Sequence[int],
    prefix_len: int,
    prompt_lens: Sequence[int],
    generated: Sequence[int],
) -> DecodeBatch:
    """Sequence i: prefix_len tokens of a prefix it shares with every sequence of the same
    prefix id (page-aligned; 0 for none), then prompt_lens[i] own prompt tokens, then
    generated[i] decoded ones. Pages are handed out as the engine would: each prompt's pages in
    one run at prefill, then decode pages one at a time as the sequences fill theirs."""
    next_page = 0

    def take(count: int) -> list[int]:
        nonlocal next_page
        next_page += count
        return list(range(next_page - count, next_page))

    prefixes = {prefix_id: take(_pages_for(prefix_len)) for prefix_id in sorted(set(prefix_ids))}
    tables = [
        prefixes[prefix_id] + take(_pages_for(prefix_len + own) - _pages_for(prefix_len))
        for prefix_id, own in zip(prefix_ids, prompt_lens, strict=True)
    ]
    context_lens = [prefix_len + own for own in prompt_lens]
    final_lens = [n + g for n, g in zip(context_lens, generated, strict=True)]
    for _ in range(max(generated)):
        for i, table in enumerate(tables):
            if context_lens[i] < final_lens[i]:
                if context_lens[i] == len(table) * PAGE_SIZE:
                    table.extend(take(1))
                context_lens[i] += 1
    return DecodeBatch(tables, context_lens, next_page)


def g1_batch(generator: torch.Generator) -> DecodeBatch:
    num_seqs = 64
    prompts = torch.randint(32, 1025, (num_seqs,), generator=generator).tolist()
    generated = torch.randint(0, 129, (num_seqs,), generator=generator).tolist()
    return make_batch([0] * num_seqs, 0, prompts, generated)


def shared_prefix_batch(generator: torch.Generator) -> DecodeBatch:
    num_seqs = 128
    prompts = torch.randint(32, 129, (num_seqs,), generator=generator).tolist()
    generated = torch.randint(0, 65, (num_seqs,), generator=generator).tolist()
    return make_batch([0] * num_seqs, 1024, prompts, generated)


# ---------------------------------------------------------------------------- the old path


def legacy_metadata(batch: DecodeBatch) -> list[dict[str, Any]]:
    """The decode groups of the SDPA path this backend had before (commit fa60270): contexts
    grouped longest first, a group closing below 70% of its longest once it has 8 members."""
    order = sorted(range(len(batch.context_lens)), key=lambda i: -batch.context_lens[i])
    members_by_group: list[list[int]] = []
    for i in order:
        group = members_by_group[-1] if members_by_group else None
        longest = batch.context_lens[group[0]] if group else 0
        if group is None or (len(group) >= 8 and batch.context_lens[i] < 0.7 * longest):
            members_by_group.append([i])
        else:
            group.append(i)
    groups = []
    for members in members_by_group:
        lens = torch.tensor([batch.context_lens[i] for i in members])
        longest = int(lens[0])
        pages = torch.zeros(len(members), _pages_for(longest), dtype=torch.int64)
        for row, i in enumerate(members):
            used = batch.page_tables[i][: _pages_for(longest)]
            pages[row, : len(used)] = torch.tensor(used)
        mask = None
        if int(lens[-1]) != longest:
            mask = (torch.arange(longest) < lens.unsqueeze(1))[:, None, None, :]
        groups.append({"rows": torch.tensor(members), "pages": pages.flatten(), "len": longest})
        groups[-1]["mask"] = mask
    return groups


def legacy_slot_mapping(batch: DecodeBatch) -> torch.Tensor:
    """Where each decode's new key and value go, computed as the old path did (for its host
    time only)."""
    slots = []
    for context_len, pages in zip(batch.context_lens, batch.page_tables, strict=True):
        positions = torch.arange(context_len - 1, context_len)
        page_ids = torch.tensor(pages, dtype=torch.int64)[positions // PAGE_SIZE]
        slots.append(page_ids * PAGE_SIZE + positions % PAGE_SIZE)
    return torch.cat(slots)


def legacy_forward(
    q: torch.Tensor, kv_layer: KVLayer, groups: list[dict[str, Any]]
) -> torch.Tensor:
    """Gathers each group's pages into [seqs, kv_heads, longest, head_dim] and runs SDPA."""

    def gathered(cache: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        num_seqs = group["rows"].shape[0]
        paged = cache.view(-1, PAGE_SIZE, *cache.shape[1:]).index_select(0, group["pages"])
        run = paged.view(num_seqs, -1, *cache.shape[1:])[:, : group["len"]]
        return run.transpose(1, 2).contiguous()

    out = torch.empty_like(q)
    for group in groups:
        num_seqs = group["rows"].shape[0]
        grouped_q = q.index_select(0, group["rows"]).view(
            num_seqs, NUM_KV_HEADS, NUM_HEADS // NUM_KV_HEADS, HEAD_DIM
        )
        keys, values = gathered(kv_layer.keys, group), gathered(kv_layer.values, group)
        attn = F.scaled_dot_product_attention(grouped_q, keys, values, attn_mask=group["mask"])
        out.index_copy_(0, group["rows"], attn.reshape(num_seqs, NUM_HEADS, HEAD_DIM))
    return out


# ---------------------------------------------------------------------------- timing


@dataclass(frozen=True)
class Step:
    """One decode step's attention inputs, layer by layer."""

    kv_layers: list[KVLayer]
    queries: list[torch.Tensor]  # [seqs, heads, head_dim] per layer
    new_keys: list[torch.Tensor]  # [seqs, kv_heads, head_dim] per layer
    new_values: list[torch.Tensor]


def make_step(
    batch: DecodeBatch, num_layers: int, generator: torch.Generator, dtype: torch.dtype
) -> Step:
    num_seqs = len(batch.context_lens)
    slots = batch.num_pages * PAGE_SIZE

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    return Step(
        kv_layers=[
            KVLayer(
                randn(slots, NUM_KV_HEADS, HEAD_DIM),
                randn(slots, NUM_KV_HEADS, HEAD_DIM),
                PAGE_SIZE,
            )
            for _ in range(num_layers)
        ],
        queries=[randn(num_seqs, NUM_HEADS, HEAD_DIM) for _ in range(num_layers)],
        new_keys=[randn(num_seqs, NUM_KV_HEADS, HEAD_DIM) for _ in range(num_layers)],
        new_values=[randn(num_seqs, NUM_KV_HEADS, HEAD_DIM) for _ in range(num_layers)],
    )


def step_runners(
    batch: DecodeBatch, step: Step, cascade_policy: CascadePolicy = DEFAULT_CASCADE_POLICY
) -> dict[str, Callable[[], list[torch.Tensor]]]:
    """Each path as a function that runs one step through every layer."""
    runners = {}
    legacy = legacy_metadata(batch)
    slot_mapping = TorchSdpaBackend().build_metadata(batch.layout, CPU).slot_mapping

    def old() -> list[torch.Tensor]:
        outs = []
        for layer, q, k, v in zip(
            step.kv_layers, step.queries, step.new_keys, step.new_values, strict=True
        ):
            layer.write(slot_mapping, k, v)
            outs.append(legacy_forward(q, layer, legacy))
        return outs

    runners["sdpa (before)"] = old
    backends: list[tuple[str, AttentionBackend]] = [
        ("paged matmul", TorchSdpaBackend(cascade=None)),
        ("paged matmul + cascade", TorchSdpaBackend(cascade_policy)),
    ]
    dtype = step.queries[0].dtype
    backends.append(("paged sdpa", TorchSdpaBackend(cascade=None, decode_form="sdpa")))
    if paged_decode_supported(CPU, dtype, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM):
        backends.append((PORTABLE_KERNEL, TorchSdpaBackend(cascade=None, decode_form="kernel")))
        backends.append(
            (f"{PORTABLE_KERNEL} + cascade", TorchSdpaBackend(cascade_policy, decode_form="kernel"))
        )
    if varlen_attention_supported(CPU, dtype, HEAD_DIM):
        backends.append((C_KERNEL, CpuKernelBackend()))
    for name, backend in backends:
        metadata = backend.build_metadata(batch.layout, CPU)

        def new(
            backend: AttentionBackend = backend, metadata: Any = metadata
        ) -> list[torch.Tensor]:
            return [
                backend.forward(q, k, v, layer, metadata)
                for layer, q, k, v in zip(
                    step.kv_layers, step.queries, step.new_keys, step.new_values, strict=True
                )
            ]

        runners[name] = new
    return runners


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


def kv_bytes_per_step(batch: DecodeBatch, num_layers: int, dtype: torch.dtype) -> int:
    """Keys and values of every distinct cached token the step attends to, in every layer:
    what a step must read at least once."""
    slots = {
        page * PAGE_SIZE + offset
        for table, context_len in zip(batch.page_tables, batch.context_lens, strict=True)
        for position in range(context_len)
        for page, offset in [(table[position // PAGE_SIZE], position % PAGE_SIZE)]
    }
    bytes_per_token = 2 * NUM_KV_HEADS * HEAD_DIM * dtype.itemsize  # keys and values
    return len(slots) * bytes_per_token * num_layers


def copy_gb_per_s(rounds: int, clock: Callable[[], float]) -> float:
    """Memory bandwidth of a large copy (bytes read plus bytes written), best of the rounds."""
    source = torch.ones(COPY_BYTES // 4, dtype=torch.float32)
    target = torch.empty_like(source)
    target.copy_(source)  # the pages are mapped before any timed copy
    best_s = float("inf")
    for _ in range(rounds):
        start = clock()
        target.copy_(source)
        best_s = min(best_s, clock() - start)
    return 2 * COPY_BYTES / best_s / 1e9


def bandwidth(kv_bytes: int, ms_per_step: dict[str, dict[str, float]], copy: float) -> dict:
    """Each path's achieved KV read bandwidth, and its share of the copy bandwidth."""
    return {
        name: {
            "kv_read_gb_per_s": kv_bytes / (t["best_ms"] / 1e3) / 1e9,
            "share_of_copy": kv_bytes / (t["best_ms"] / 1e3) / 1e9 / copy,
        }
        for name, t in ms_per_step.items()
    }


def metadata_ms(batch: DecodeBatch, rounds: int) -> dict[str, float]:
    """Best host time to build a step's metadata, old path and new."""
    result = {}
    for name, build in (
        ("sdpa (before)", lambda: (legacy_slot_mapping(batch), legacy_metadata(batch))),
        ("paged matmul + cascade", lambda: TorchSdpaBackend().build_metadata(batch.layout, CPU)),
        (C_KERNEL, lambda: CpuKernelBackend().build_metadata(batch.layout, CPU)),
    ):
        best = float("inf")
        for _ in range(rounds):
            start = time.perf_counter()
            build()
            best = min(best, time.perf_counter() - start)
        result[name] = best * 1e3
    return result


def run_workload(
    batch: DecodeBatch, args: argparse.Namespace, generator: torch.Generator
) -> dict[str, Any]:
    step = make_step(batch, args.layers, generator, args.dtype)
    runners = step_runners(batch, step)
    outputs = {name: run()[0].float() for name, run in runners.items()}  # also warms up
    reference = outputs["sdpa (before)"]
    kv_bytes = kv_bytes_per_step(batch, args.layers, args.dtype)
    timings = {}
    for setting in SETTINGS:
        torch.set_num_threads(setting.threads)
        clock = CLOCKS[setting.clock]
        with harness.timed_section() as section:
            ms = interleaved_best_ms(runners, args.rounds, clock)
            copy = copy_gb_per_s(args.rounds, clock)
        best_before = ms["sdpa (before)"]["best_ms"]
        timings[setting.name] = {
            "threads": setting.threads,
            "clock": setting.clock,
            "ms_per_step": ms,
            "speedup_vs_before": {name: best_before / t["best_ms"] for name, t in ms.items()},
            "copy_gb_per_s": copy,
            "kv_bandwidth": bandwidth(kv_bytes, ms, copy),
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
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT_PATH)
    args = parser.parse_args()
    if args.dtype == "auto":
        has_bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
        args.dtype = "bfloat16" if has_bf16 else "float32"
    args.dtype = getattr(torch, args.dtype)
    generator = torch.Generator().manual_seed(0)
    results: dict[str, Any] = {
        "machine": harness.machine_description(),
        "dtype": str(args.dtype).removeprefix("torch."),
        "workloads": {},
    }
    for name, make in (("g1", g1_batch), ("shared_prefix", shared_prefix_batch)):
        harness.log(f"{name}: timing", "decode_attention")
        results["workloads"][name] = run_workload(make(generator), args, generator)
    if args.sweep:
        torch.set_num_threads(SWEEP_SETTING.threads)
        results["cascade_sweep"] = {
            "threads": SWEEP_SETTING.threads,
            "clock": SWEEP_SETTING.clock,
            "num_layers": args.sweep_layers,
            "rows": run_sweep(args, generator),
        }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    print(
        "| workload | timing | path | best ms/step | median ms/step | speed-up "
        "| KV read GB/s | of copy GB/s |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for name, workload in results["workloads"].items():
        for setting, timing in workload["timings"].items():
            for path, t in timing["ms_per_step"].items():
                speedup = timing["speedup_vs_before"][path]
                achieved = timing["kv_bandwidth"][path]
                print(
                    f"| {name} | {setting} | {path} | {t['best_ms']:.1f} | {t['median_ms']:.1f} "
                    f"| {speedup:.2f}x | {achieved['kv_read_gb_per_s']:.3g} "
                    f"| {achieved['share_of_copy']:.0%} of {timing['copy_gb_per_s']:.1f} |"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
