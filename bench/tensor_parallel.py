"""Tensor parallelism on a CPU: one process against the model split over --tp-size ranks.

A random-weight checkpoint with Qwen2.5-0.5B's shapes (default) runs two workloads at each
tensor parallel size, each size in its own worker process (rank 0; the other ranks are its
children):
- generate: --num-prompts random-token prompts of --min/--max-prompt-len tokens, --max-tokens
  greedy output tokens each (EOS ignored);
- loglikelihood: --num-docs random-token documents of --doc-len tokens, scored in packed bins.

Reported per size and workload: wall time, tokens per second (generate: prompt and output
tokens; loglikelihood: scored tokens), the ratio to one process, and the communication time
rank 0 spent inside gloo collectives (all-reduces, LM-head gathers, broadcasts of the step's
inputs; waiting for the slower rank included): per engine step from the step timeline
(`collective_s`), and per packed bin for loglikelihood. The generated tokens of every size are
hashed: the sizes must agree (float32 by default, greedy).

On a CPU the ranks share the machine's cores (each rank takes 1/N of torch's threads), so
splitting the model adds communication without adding compute: at a real model's shapes,
expect tensor parallel 2 to be slower than one process, or even at best, on a small machine.
(On the tiny shape of the quick check, one process's two OpenMP threads cost more than they
give on such small matmuls, so its figures say nothing about tensor parallelism.) What it buys
is memory per process (each rank holds about 1/N of the weights), and on GPUs one device per
rank.

Full run (a few minutes on a quiet 2-core CPU):
    python bench/tensor_parallel.py
Quick check:
    python bench/tensor_parallel.py --shape tiny --num-prompts 4 --max-tokens 8 --num-docs 8 \\
        --doc-len 64 --output bench/results/tmp/tp.json --plot bench/results/tmp/tp.png
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import checkpoints
import harness
import process_timing
import torch
import workers

REPO_ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = ("generate", "loglikelihood")
FORWARDED = (
    "model_dir", "tp_size", "dtype", "num_prompts", "min_prompt_len", "max_prompt_len",
    "max_tokens", "num_docs", "doc_len", "max_num_batched_tokens",
)  # fmt: skip
TINY_SHAPE = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 2048,
    "max_position_embeddings": 2048,
}


def log(message: str) -> None:
    harness.log(message, "tp")


def ensure_checkpoint(args: argparse.Namespace) -> Path:
    if args.shape != "tiny":
        return checkpoints.ensure_shapes_checkpoint(
            args.shape, checkpoints.CHECKPOINT_CACHE_DIR / f"tp-{args.shape}-shapes", "tp"
        )
    model_dir = checkpoints.CHECKPOINT_CACHE_DIR / "tp-tiny"
    if not (model_dir / "config.json").exists():
        from vacpack.testing.tiny_models import build_random_checkpoint

        model_dir.parent.mkdir(parents=True, exist_ok=True)
        partial_dir = model_dir.with_name(f"{model_dir.name}.partial-{os.getpid()}")
        build_random_checkpoint(TINY_SHAPE, "qwen2", partial_dir, dtype=torch.float32)
        partial_dir.rename(model_dir)
    return model_dir


def _collective_s(llm: Any) -> float:
    """Rank 0's seconds inside gloo collectives since the group formed (0 for one process)."""
    collectives = llm.loaded.tp.collectives
    return collectives.blocked_s if collectives is not None else 0.0


def run_generate(llm: Any, args: argparse.Namespace) -> dict[str, Any]:
    from vacpack import SamplingParams

    prompts = harness.random_token_prompts(
        args.num_prompts, args.min_prompt_len, args.max_prompt_len, llm.loaded.config.vocab_size, 0
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    # Warm-up on the same prompts: measured kernel choices are timed (or read from their cache)
    # on first use of a shape, which must not fall into either size's timed run.
    llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    llm.engine.timeline.reset()
    with process_timing.timed_section() as section:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    steps = llm.engine.timeline.steps
    collective = [s.collective_s for s in steps if s.collective_s is not None]
    num_tokens = sum(len(p) for p in prompts) + args.num_prompts * args.max_tokens
    token_ids = [output.outputs[0].token_ids for output in outputs]
    return {
        **section.fields(),
        "tokens_per_s": num_tokens / section.wall_s,
        "output_tokens_per_s": args.num_prompts * args.max_tokens / section.wall_s,
        "num_steps": len(steps),
        "collective_s": sum(collective),
        "collective_s_per_step": sum(collective) / len(steps) if collective else 0.0,
        "collective_fraction": sum(collective) / section.wall_s,
        "output_sha256": hashlib.sha256(json.dumps(token_ids).encode()).hexdigest()[:16],
        **harness.vacpack_engine_fields(llm),
    }


def run_loglikelihood(llm: Any, args: argparse.Namespace) -> dict[str, Any]:
    # Token ids, as P1 scores them: decoded to text, ids the bundled 2,048-token tokenizer
    # does not know would vanish (a document of them comes back empty).
    texts = harness.random_token_prompts(
        args.num_docs, args.doc_len, args.doc_len, llm.loaded.config.vocab_size, 1
    )
    llm.loglikelihood(texts, use_tqdm=False)  # warm-up: kernel choices, the bin budget
    before_s = _collective_s(llm)
    with process_timing.timed_section() as section:
        llm.loglikelihood(texts, use_tqdm=False)
    collective_s = _collective_s(llm) - before_s
    report = llm.corpus_runner.last_report
    return {
        **section.fields(),
        **harness.job_report_fields(report),
        "collective_s": collective_s,
        "collective_s_per_bin": collective_s / max(1, report.num_bins),
        "collective_fraction": collective_s / section.wall_s,
    }


def run_worker(args: argparse.Namespace) -> dict[str, Any]:
    from vacpack import LLM

    def run() -> dict[str, Any]:
        engine_args: dict[str, Any] = {}
        if args.max_num_batched_tokens:
            engine_args["max_num_batched_tokens"] = args.max_num_batched_tokens
        max_model_len = max(args.max_prompt_len + args.max_tokens, args.doc_len) + 1
        with LLM(
            str(args.model_dir),
            dtype=args.dtype,
            device="cpu",
            max_model_len=max_model_len,
            tensor_parallel_size=args.tp_size,
            **engine_args,
        ) as llm:
            rank_stats = llm.loaded.rank_load_stats or (llm.loaded.load_stats,)
            return {
                "tensor_parallel_size": args.tp_size,
                "rank_parameter_bytes": [s.parameter_bytes for s in rank_stats],
                "generate": run_generate(llm, args),
                "loglikelihood": run_loglikelihood(llm, args),
            }

    log(f"tensor parallel {args.tp_size}: generate, then loglikelihood")
    return workers.run_catching_errors(run)


def _speed(row: dict[str, Any], workload: str) -> float:
    return float(row[workload]["tokens_per_s"])


def table(results: dict[str, Any], sizes: list[int]) -> str:
    lines = [
        "| TP | workload | wall s | tokens/s | vs TP 1 | collective s/step (bin) | share |",
        "|---|---|---|---|---|---|---|",
    ]
    baseline = results["tp1"]
    for size in sizes:
        row = results[f"tp{size}"]
        if "error" in row:
            lines.append(f"| {size} | {harness.markdown_cell(row['error'])} | | | | | |")
            continue
        for workload in WORKLOADS:
            part = row[workload]
            ratio = (
                f"{_speed(row, workload) / _speed(baseline, workload):.2f}x"
                if "error" not in baseline
                else "-"
            )
            per_unit = part.get("collective_s_per_step", part.get("collective_s_per_bin", 0.0))
            lines.append(
                f"| {size} | {workload} | {part['wall_s']:.2f} | {part['tokens_per_s']:.1f} | "
                f"{ratio} | {per_unit * 1e3:.2f} ms | {part['collective_fraction']:.0%} |"
            )
    return "\n".join(lines)


def save_plot(results: dict[str, Any], plot_path: Path) -> None:
    values = {
        f"{workload}\nTP {results[key]['tensor_parallel_size']}": _speed(results[key], workload)
        for workload in WORKLOADS
        for key in results["sizes"]
        if "error" not in results[key]
    }
    machine = harness.machine_summary(results["machine"])
    harness.save_bar_chart(
        values,
        plot_path,
        ylabel="tokens/s",
        title=f"tensor parallel on a CPU, {results['args']['shape']} shapes\n{machine}",
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=["qwen2.5-0.5b", "tiny"], default="qwen2.5-0.5b")
    parser.add_argument("--tp-sizes", default="1,2", help="comma-separated sizes; 1 comes first")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--min-prompt-len", type=int, default=64)
    parser.add_argument("--max-prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-docs", type=int, default=64)
    parser.add_argument("--doc-len", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--output", type=Path, default=REPO_ROOT / "bench/results/tp_cpu.json")
    parser.add_argument("--plot", type=Path, default=None, help="default: --output as .png")
    parser.add_argument("--model-dir", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--tp-size", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-output", type=Path, default=None, help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.worker is not None:
        workers.save_worker_result(run_worker(args), args.worker_output)
        return
    sizes = sorted({1, *(int(size) for size in args.tp_sizes.split(","))})
    args.model_dir = ensure_checkpoint(args)
    results: dict[str, Any] = {
        "machine": harness.machine_description(),
        "args": {key: str(value) for key, value in vars(args).items()},
        "sizes": [f"tp{size}" for size in sizes],
    }
    for size in sizes:
        args.tp_size = size
        results[f"tp{size}"] = workers.run_worker(
            lambda output, size=size: workers.worker_command(
                __file__, f"tp{size}", output, args, FORWARDED
            ),
            f"tp{size}",
            "tp",
        )
    hashes = {
        key: results[key]["generate"]["output_sha256"]
        for key in results["sizes"]
        if "error" not in results[key]
    }
    results["same_generated_tokens"] = len(set(hashes.values())) <= 1
    if not results["same_generated_tokens"]:
        log(f"the sizes generated different tokens: {hashes}")
    workers.publish_results(results, args.output, args.plot, save_plot, table(results, sizes), "tp")


if __name__ == "__main__":
    main()
