"""Measured choices checked afterwards. Loads a model --loads times with one choice cache (a
fresh one unless --cache-dir names one), records the last load's choices, the engine's
included, and times each choice's candidates again over --rounds interleaved rounds
(vacpack.tuning.audit). For each phase and shape: what the load chose and on how many rounds,
the audit's fastest candidate, and how much slower the chosen one ran than it (the bound this
project holds its choices to: 10%). A table, a JSON file and a chart.

    python bench/choice_audit.py             # a new user's first load: about 2 minutes
    python bench/choice_audit.py --loads 2   # once a second load has settled the first's
    python bench/choice_audit.py --e1        # E1's encoder (all-MiniLM-L6-v2) instead of G1's
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import checkpoints
import e1_workload
import harness
import torch

from vacpack import LLM
from vacpack.tuning import CACHE_ENV, RecordedChoice, audit, recording
from vacpack.tuning.audit import AUDIT_ROUNDS

RESULTS = harness.REPO_ROOT / "bench" / "results" / "choice_audit_cpu.json"
E1_RESULTS = RESULTS.with_name("choice_audit_cpu_e1.json")
# A chosen candidate this much slower than the fastest fails the audit.
SLOWDOWN_BOUND = 1.10
E1_WARM_UP_TEXTS = ["a short query", " ".join(["a passage of words"] * 40)]


def load_and_record(args: argparse.Namespace) -> list[RecordedChoice]:
    """The last of --loads loads' choices (each load a new LLM, as a new process would be)."""
    if args.e1:
        model_dir = args.model_dir or e1_workload.default_model_dir()
    else:
        model_dir = args.model_dir or checkpoints.QWEN2_5_0_5B_SHAPES_DIR
        model_dir = checkpoints.ensure_qwen2_5_0_5b_shapes_checkpoint(model_dir, "audit")
    last: list[RecordedChoice] = []
    for load_index in range(args.loads):
        with recording() as recorded:
            llm = LLM(
                str(model_dir),
                dtype=args.dtype,
                device="cpu",
                max_num_seqs=args.max_num_seqs,
                kv_cache_memory_bytes=args.kv_cache_gib * 2**30,
            )
            if llm.loaded.is_decoder:
                llm.engine  # noqa: B018 - the engine's attention choices are made here
            else:  # an encoder's are made by its first corpus job
                llm.embed(E1_WARM_UP_TEXTS, use_tqdm=False)
        spent_s = llm.loaded.timing_allowance.spent_s
        harness.log(f"load {load_index + 1}: {spent_s:.2f} s of timing, {len(recorded)} choices")
        last = recorded
        del llm
        gc.collect()
    return last


def markdown_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| phase | shapes | chosen (load rounds) | audit: each candidate's best ms | fastest | "
        "chosen / fastest |",
        "|---|---|---|---|---|---:|",
    ]
    for r in rows:
        times = ", ".join(f"{name} {t * 1e3:.3g}" for name, t in r["best_time_s"].items())
        mark = "" if r["chosen_over_fastest"] <= SLOWDOWN_BOUND else " **over 10%**"
        lines.append(
            f"| {r['phase']} | {harness.markdown_cell(r['shape_key'])} | {r['chosen']} "
            f"({r['load_rounds']}) | {times} | {r['fastest']} | "
            f"{r['chosen_over_fastest']:.3f}{mark} |"
        )
    return "\n".join(lines)


def shorter(text: str, max_chars: int) -> str:
    return text if len(text) <= max_chars else "..." + text[-(max_chars - 3) :]


def save_plot(rows: list[dict[str, Any]], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # A shape key's end tells apart the choices of one phase (the batch, the shared prefix).
    labels = [f"{r['phase']}\n{shorter(r['shape_key'], 56)}" for r in rows]
    ratios = [min(r["chosen_over_fastest"], 3.0) for r in rows]  # a failed one drawn at 3
    colours = ["tab:red" if x > SLOWDOWN_BOUND else "tab:blue" for x in ratios]
    figure, axes = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.5))
    positions = list(range(len(rows)))
    axes.barh(positions, ratios, color=colours)
    axes.axvline(SLOWDOWN_BOUND, color="tab:red", linestyle="--", label="10% slower")
    axes.set_yticks(positions, labels, fontsize=6)
    axes.invert_yaxis()
    axes.set_xlim(0.9, max([*ratios, SLOWDOWN_BOUND]) * 1.05)
    axes.set_xlabel("chosen candidate's time / fastest candidate's, in the audit")
    axes.set_title(title, fontsize=9)
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, help="default: G1's model (E1's with --e1)")
    parser.add_argument("--e1", action="store_true", help="E1's encoder, all-MiniLM-L6-v2")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--loads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=AUDIT_ROUNDS)
    parser.add_argument("--cache-dir", type=Path, help="choice cache (default: a fresh one)")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="G1's decode batch")
    parser.add_argument("--kv-cache-gib", type=int, default=2)
    parser.add_argument("--output", type=Path, help=f"default: {RESULTS.name} ({E1_RESULTS.name})")
    args = parser.parse_args()
    cache_dir = args.cache_dir or Path(tempfile.mkdtemp(prefix="vacpack-choice-audit-"))
    os.environ[CACHE_ENV] = str(cache_dir)
    args.output = args.output or (E1_RESULTS if args.e1 else RESULTS)
    machine = harness.machine_description()
    recorded = load_and_record(args)
    harness.log(f"timing {len(recorded)} choices again, {args.rounds} rounds each")
    with torch.inference_mode():
        rows = [row.to_dict() for row in audit(recorded, rounds=args.rounds)]
    within = sum(r["chosen_over_fastest"] <= SLOWDOWN_BOUND for r in rows)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    model = "all-MiniLM-L6-v2" if args.e1 else "Qwen2.5-0.5B shapes"
    settings = {"model": model, "dtype": args.dtype, "loads": args.loads, "rounds": args.rounds}
    args.output.write_text(
        json.dumps({"machine": machine, **settings, "rows": rows}, indent=1) + "\n"
    )
    plot = args.output.with_suffix(".png")
    title = (
        f"Measured choices audited after {args.loads} load(s), {model}, {args.dtype},\n"
        f"{harness.machine_summary(machine)}"
    )
    save_plot(rows, title, plot)
    print(f"measured {harness.machine_summary(machine)}; {within} of {len(rows)} choices within "
          f"10% of their fastest candidate")  # fmt: skip
    print(markdown_table(rows))
    print(f"wrote {args.output} and {plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
