"""The CPU issue's (#14) targets, read from the results one CPU session wrote: one row per target
with the measured value, the target, whether it is met, the CPU it ran on and the file it came
from. Prints a table, writes JSON and a bar chart (each target's measured value over its
target: 1 or more is met).

The files are named by the CPU session's tag (bench/cpu_session.sh: `zen3`, `zen4`,
`xeon_amx`, ...), e.g. bench/results/p1_cpu_zen3.json, so that runs on different kinds of CPU
never overwrite each other; an empty tag reads the untagged files committed before the session
script existed. `--file SOURCE=PATH` reads one source from another file.

    python bench/cpu_targets.py --tag zen3
    python bench/cpu_targets.py --tag "" \
        --file g1_generate=bench/results/g1_qwen2.5-0.5b_cpu_bf16.json
    python bench/cpu_targets.py --print-tag      # the tag of this machine's CPU
    python bench/cpu_targets.py --print-dtype    # the dtype the session runs in here
    python bench/cpu_targets.py --tag zen3 --path-of p1   # where the session writes P1

Deliberately free of torch and of the other bench modules (but cpu_target_measures.py, what
each target reads from its file), so that it reads results in a fraction of a second (its
test runs on every `make test`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cpu_target_measures import (
    AUDIT_BOUND,
    Measured,
    audit_worst,
    decode_share_of_copy,
    e1_bf16_over_st,
    e1_over_vllm,
    g1_over,
    p1_over_vllm,
    shared_prompt_over_vllm,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "bench" / "results"

# Source -> its file name before the tag and ".json". The session script asks for these names
# (--path-of), so this is the one place they are spelled.
FILE_STEMS: dict[str, str] = {
    "g1_vllm": "g1_qwen2.5-0.5b_cpu",
    "g1_generate": "g1_qwen2.5-0.5b_cpu_generate",
    "p1": "p1_cpu",
    "e1": "e1_cpu",
    "e1_bf16": "e1_cpu_bf16",
    "prefix": "prefix_cpu",
    "decode": "decode_attention_cpu",
    "prefill": "prefill_attention_cpu",
    "audit": "choice_audit_cpu",
    "audit_e1": "choice_audit_cpu_e1",
    "cpu_info": "cpu_info",
    "targets": "cpu_targets",
}

# The CPU flags that make bf16 arithmetic native (else oneDNN emulates it, several times slower).
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


# ---------------------------------------------------------------------------- the CPU


def parse_cpuinfo(text: str) -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (every core repeats them)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_tag(cpuinfo_text: str, machine: str | None = None) -> str:
    """A short name for the kind of CPU, for result file names: what the issue's targets are
    checked on (Zen 3, Zen 4, an Intel Xeon with AMX), told apart by the instructions that
    decide which kernels run."""
    fields = parse_cpuinfo(cpuinfo_text)
    flags = set(fields.get("flags", "").split())
    vendor = fields.get("vendor_id", "")
    family = int(fields.get("cpu family", "0") or 0)
    if vendor == "AuthenticAMD":
        # Family 25 (0x19) holds both Zen 3 and Zen 4; of the two only Zen 4 has AVX-512.
        if family == 25:
            return "zen4" if "avx512f" in flags else "zen3"
        if family == 26:
            return "zen5"
        if family == 23:
            return "zen2" if int(fields.get("model", "0") or 0) >= 0x30 else "zen1"
        return f"amd_family{family}"
    if vendor == "GenuineIntel":
        if "amx_tile" in flags:
            return "xeon_amx"
        if "avx512_bf16" in flags:
            return "intel_avx512_bf16"
        return "intel_avx512" if "avx512f" in flags else "intel_avx2"
    return (machine or platform.machine() or "cpu").lower()


def session_dtype(cpuinfo_text: str) -> str:
    """bfloat16 where the CPU computes it natively, float32 elsewhere, as the issue's runs did
    (its Zen 4 and Xeon rows in bf16, the AVX2-only Zen 3's in float32)."""
    flags = set(parse_cpuinfo(cpuinfo_text).get("flags", "").split())
    return "bfloat16" if flags & BF16_FLAGS else "float32"


def read_cpuinfo() -> str:
    path = Path("/proc/cpuinfo")
    return path.read_text() if path.exists() else ""


# ---------------------------------------------------------------------------- result files


def result_path(source: str, tag: str, results_dir: Path = RESULTS_DIR) -> Path:
    suffix = f"_{tag}" if tag else ""
    return results_dir / f"{FILE_STEMS[source]}{suffix}.json"


def result_files(
    tag: str, results_dir: Path = RESULTS_DIR, overrides: Mapping[str, Path] | None = None
) -> dict[str, Path]:
    files = {source: result_path(source, tag, results_dir) for source in FILE_STEMS}
    files.update(overrides or {})
    return files


# ---------------------------------------------------------------------------- targets


@dataclass(frozen=True)
class Target:
    name: str
    source: str  # a key of FILE_STEMS
    goal: float
    higher_is_better: bool
    measure: Callable[[dict[str, Any]], Measured]


@dataclass(frozen=True)
class TargetRow:
    target: str
    measured: float | None
    goal: float
    comparison: str  # ">=" or "<="
    met: bool | None  # None: not measured (no file, a failed system, ...)
    cpu: str | None
    file: str
    written: str | None  # the file's modification time, UTC
    stale: bool  # written before the run being judged began (--since): an earlier run's
    detail: str


TARGETS: tuple[Target, ...] = (
    Target("G1 vs vLLM CPU", "g1_vllm", 1.2, True, g1_over("vllm_cpu")),
    Target("P1 vs vLLM CPU", "p1", 1.2, True, p1_over_vllm),
    Target("E1 vs vLLM CPU", "e1", 1.2, True, e1_over_vllm),
    Target("shared prompt vs vLLM CPU", "prefix", 1.2, True, shared_prompt_over_vllm),
    Target("G1 vs transformers generate", "g1_generate", 5.0, True, g1_over("hf_generate")),
    Target("E1 bf16 vs sentence-transformers bf16", "e1_bf16", 2.0, True, e1_bf16_over_st),
    Target("decode attention KV read / copy bandwidth", "decode", 0.6, True, decode_share_of_copy),
    # Chosen candidate's time over the fastest's, at the choice where it is largest.
    Target("choice audit, G1's model", "audit", AUDIT_BOUND, False, audit_worst),
    Target("choice audit, E1's encoder", "audit_e1", AUDIT_BOUND, False, audit_worst),
)  # fmt: skip


def cpu_description(machine: Mapping[str, Any]) -> str:
    flags = machine.get("bf16_cpu_flags") or []
    return (
        f"{machine.get('cpu_model', 'unknown CPU')}, {machine.get('num_usable_cores', '?')} cores"
        + (f" ({', '.join(flags)})" if flags else ", no AVX-512")
    )


def repo_relative(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def read_target(target: Target, path: Path, since: float | None = None) -> TargetRow:
    """`target`'s row from `path`; with `since` (a Unix time), a file written before it is
    marked stale: the issue asks for every row from one run."""
    comparison = ">=" if target.higher_is_better else "<="
    modified = path.stat().st_mtime if path.exists() else None
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        data, measured = None, Measured(None, "no file: the stage did not run or did not finish")
    except (OSError, json.JSONDecodeError) as error:
        data, measured = None, Measured(None, f"unreadable: {error}")
    else:
        try:
            measured = target.measure(data)
        except (KeyError, TypeError, ValueError) as error:  # a file of another format
            measured = Measured(None, f"unexpected format ({type(error).__name__}: {error})")
    met = None
    if measured.value is not None:
        met = (
            measured.value >= target.goal
            if target.higher_is_better
            else measured.value <= target.goal
        )
    machine = data.get("machine") if isinstance(data, dict) else None
    return TargetRow(
        target=target.name,
        measured=measured.value,
        goal=target.goal,
        comparison=comparison,
        met=met,
        cpu=cpu_description(machine) if machine else None,
        file=repo_relative(path),
        written=(
            None
            if modified is None
            else datetime.datetime.fromtimestamp(modified, datetime.timezone.utc).isoformat(
                timespec="seconds"
            )
        ),
        stale=since is not None and modified is not None and modified < since,
        detail=measured.detail,
    )


def read_targets(files: Mapping[str, Path], since: float | None = None) -> list[TargetRow]:
    """One row per target of the issue, from `files` (source -> path, as result_files gives)."""
    return [read_target(target, files[target.source], since) for target in TARGETS]


# ---------------------------------------------------------------------------- output


def status(row: TargetRow) -> str:
    text = {True: "met", False: "NOT met", None: "missing"}[row.met]
    return f"{text} (earlier run)" if row.stale else text


def format_value(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def markdown_table(rows: list[TargetRow]) -> str:
    lines = [
        "| target | measured | target | status | CPU | file | detail |",
        "|---|---:|---:|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row.target} | {format_value(row.measured)} | {row.comparison} {row.goal:g} | "
            f"{status(row)} | {row.cpu or '—'} | {row.file} | {row.detail.replace('|', '/')} |"
        )
    return "\n".join(lines)


MAX_PLOTTED_SCORE = 2.5


def save_plot(rows: list[TargetRow], title: str, path: Path) -> None:
    """Each target's measured value over its target (target over measured where lower is
    better), so that 1 or more is met on every bar; a missing row is drawn empty."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a benchmark machine
    import matplotlib.pyplot as plt

    def score(row: TargetRow) -> float:
        if row.measured is None:
            return 0.0
        return row.measured / row.goal if row.comparison == ">=" else row.goal / row.measured

    # Clipped, so that a 10x lead does not squash the rows near 1 that decide; labels say all.
    scores = [min(score(row), MAX_PLOTTED_SCORE) for row in rows]
    colours = {True: "tab:green", False: "tab:red", None: "tab:gray"}
    figure, axes = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.6))
    positions = list(range(len(rows)))
    bars = axes.barh(positions, scores, color=[colours[row.met] for row in rows])
    axes.bar_label(
        bars,
        labels=[
            f" {format_value(row.measured)} ({row.comparison} {row.goal:g}): {status(row)}"
            for row in rows
        ],
        fontsize=7,
    )
    axes.axvline(1.0, color="black", linestyle="--", linewidth=1)
    axes.set_yticks(positions, [row.target for row in rows], fontsize=7)
    axes.invert_yaxis()
    axes.set_xlim(0, MAX_PLOTTED_SCORE * 1.6)
    axes.set_xlabel("measured / target (target / measured where lower is better): 1 or more met")
    axes.set_title(title, fontsize=9)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def parse_overrides(items: list[str]) -> dict[str, Path]:
    overrides = {}
    for item in items:
        source, separator, path = item.partition("=")
        if not separator or source not in FILE_STEMS:
            raise SystemExit(f"--file takes SOURCE=PATH, SOURCE one of {', '.join(FILE_STEMS)}")
        overrides[source] = Path(path)
    return overrides


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tag", default=None, help="default: this machine's (--print-tag)")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--file", action="append", default=[], metavar="SOURCE=PATH")
    parser.add_argument("--output", type=Path, help="default: cpu_targets_TAG.json there")
    parser.add_argument(
        "--since", type=float, help="Unix time the run began: older files are marked stale"
    )
    parser.add_argument("--print-tag", action="store_true", help="print this CPU's tag, exit")
    parser.add_argument("--print-dtype", action="store_true", help="print the session's dtype")
    parser.add_argument("--path-of", choices=sorted(FILE_STEMS), help="print a result's path")
    args = parser.parse_args(argv)
    if args.print_tag:
        print(cpu_tag(read_cpuinfo()))
        return 0
    if args.print_dtype:
        print(session_dtype(read_cpuinfo()))
        return 0
    tag = cpu_tag(read_cpuinfo()) if args.tag is None else args.tag
    if args.path_of:
        print(result_path(args.path_of, tag, args.results_dir))
        return 0

    files = result_files(tag, args.results_dir, parse_overrides(args.file))
    rows = read_targets(files, args.since)
    output = args.output or result_path("targets", tag, args.results_dir)
    cpus = sorted({row.cpu for row in rows if row.cpu})
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(
        json.dumps({"tag": tag, "cpus": cpus, "rows": [asdict(r) for r in rows]}, indent=1) + "\n"
    )
    plot = output.with_suffix(".png")
    met = sum(row.met is True for row in rows)
    save_plot(rows, f"#14's CPU targets, tag {tag or '(none)'}: {met} of {len(rows)} met\n"
              f"{'; '.join(cpus) or 'no results'}", plot)  # fmt: skip
    print(markdown_table(rows))
    print(
        f"{met} of {len(rows)} targets met, {sum(r.met is None for r in rows)} missing"
        + (f", {sum(r.stale for r in rows)} from earlier runs" if args.since else "")
    )
    if len(cpus) > 1:  # the issue asks for every row from one run on one machine
        print(f"WARNING: the rows come from {len(cpus)} different CPUs: {'; '.join(cpus)}")
    print(f"wrote {output} and {plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
