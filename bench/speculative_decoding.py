"""Speculative decoding's payoff against its acceptance: greedy decoding with and without it.

The model is G1's random-weight Qwen2.5-0.5B-shaped checkpoint. Random weights never repeat
their prompt the way a real model quoting its input does, so what the n-gram lookup would find
cannot be measured here; the drafts come from an oracle instead: the plain run's own output,
with a chosen share of the draft tokens corrupted, so that the runs span full acceptance (text
the lookup predicts perfectly), half, and none (every draft rejected: speculation's whole cost).
Each run's outputs are checked equal to the plain run's.

Runs are interleaved over --rounds, best of each kept, in one process on the CPU at hand (or
the GPU with --device cuda). Reported per run: output tokens per second, the speed against plain
decoding, draft tokens verified and accepted, and engine steps.

    python bench/speculative_decoding.py                       # batch 1, 4 drafts
    python bench/speculative_decoding.py --num-seqs 4 --num-drafts 8
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import checkpoints
import harness
import workers

from vacpack import LLM, SamplingParams
from vacpack.engine import speculation

REPO_ROOT = Path(__file__).resolve().parent.parent
# Share of draft positions corrupted, per run.
CORRUPTED_SHARES = {"all drafts right": 0.0, "half wrong": 0.5, "all wrong": 1.0}


def log(message: str) -> None:
    harness.log(message, "spec")


def oracle(
    continuations: dict[tuple[int, ...], list[int]], corrupted_share: float
) -> Callable[[list[int], int, int, int], list[int]]:
    """A draft proposer that reads ahead in the known continuation, corrupting every k-th
    position (k = 1 / corrupted_share) counted from the first output token."""
    period = round(1 / corrupted_share) if corrupted_share else 0

    def drafts(token_ids: list[int], min_ngram: int, max_ngram: int, max_drafts: int) -> list[int]:
        for prompt, continuation in continuations.items():
            if tuple(token_ids[: len(prompt)]) == prompt:
                done = len(token_ids) - len(prompt)
                proposed = continuation[done : done + max_drafts]
                return [
                    token + 1 if period and (done + i) % period == 0 else token
                    for i, token in enumerate(proposed)
                ]
        return []

    return drafts


def timed_generate(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> dict[str, Any]:
    before = llm.engine.state()
    start_s = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed_s = time.perf_counter() - start_s
    after = llm.engine.state()
    return {
        "elapsed_s": elapsed_s,
        "tokens": [o.outputs[0].token_ids for o in outputs],
        "num_steps": after.num_steps - before.num_steps,
        "num_draft_tokens": after.num_draft_tokens - before.num_draft_tokens,
        "num_accepted_draft_tokens": (
            after.num_accepted_draft_tokens - before.num_accepted_draft_tokens
        ),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    model_dir = checkpoints.ensure_qwen2_5_0_5b_shapes_checkpoint(args.model_dir, "spec")
    engine_args = {"dtype": args.dtype, "device": args.device, "max_model_len": 2048}
    plain = LLM(str(model_dir), **engine_args)
    speculative = LLM(str(model_dir), num_speculative_tokens=args.num_drafts, **engine_args)
    prompts = harness.random_token_prompts(
        args.num_seqs, args.prompt_len, args.prompt_len, plain.loaded.config.vocab_size, seed=0
    )
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    log("warm-up and the reference outputs")
    reference = timed_generate(plain, prompts, params)
    continuations = {tuple(p): t for p, t in zip(prompts, reference["tokens"], strict=True)}
    timed_generate(speculative, prompts, params)
    best: dict[str, dict[str, Any]] = {}
    for round_index in range(args.rounds):
        for name in ["plain", *CORRUPTED_SHARES]:
            llm = plain if name == "plain" else speculative
            if name != "plain":
                speculation.propose_ngram_drafts = oracle(continuations, CORRUPTED_SHARES[name])
            result = timed_generate(llm, prompts, params)
            if result["tokens"] != reference["tokens"]:
                raise AssertionError(f"{name}: outputs differ from plain decoding")
            log(f"round {round_index + 1} {name}: {result['elapsed_s']:.2f} s")
            if name not in best or result["elapsed_s"] < best[name]["elapsed_s"]:
                best[name] = result
    num_output_tokens = args.num_seqs * args.max_tokens
    rows = {}
    for name, result in best.items():
        rows[name] = {
            "elapsed_s": result["elapsed_s"],
            "output_tokens_per_s": num_output_tokens / result["elapsed_s"],
            "speed_vs_plain": best["plain"]["elapsed_s"] / result["elapsed_s"],
            "num_steps": result["num_steps"],
            "num_draft_tokens": result["num_draft_tokens"],
            "num_accepted_draft_tokens": result["num_accepted_draft_tokens"],
        }
    return {
        "machine": harness.machine_description(),
        "workload": {
            "model": "random-weight Qwen2.5-0.5B shapes",
            "dtype": plain.loaded.dtype_description,
            "num_seqs": args.num_seqs,
            "prompt_len": args.prompt_len,
            "max_tokens": args.max_tokens,
            "num_speculative_tokens": args.num_drafts,
            "rounds": args.rounds,
        },
        "runs": rows,
    }


def table(results: dict[str, Any]) -> str:
    workload = results["workload"]
    lines = [
        f"{harness.machine_summary(results['machine'])}; {workload['model']}, "
        f"{workload['dtype']}; {workload['num_seqs']} sequence(s), {workload['max_tokens']} "
        f"greedy tokens, up to {workload['num_speculative_tokens']} drafts a step",
        "",
        "| run | output tok/s | vs plain | drafts accepted | steps |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, row in results["runs"].items():
        drafted = row["num_draft_tokens"]
        accepted = f"{row['num_accepted_draft_tokens']} of {drafted}" if drafted else "-"
        lines.append(
            f"| {name} | {row['output_tokens_per_s']:.1f} | {row['speed_vs_plain']:.2f}x | "
            f"{accepted} | {row['num_steps']} |"
        )
    return "\n".join(lines)


def save_plot(results: dict[str, Any], plot_path: Path) -> None:
    runs = results["runs"]
    harness.save_bar_chart(
        {name: row["output_tokens_per_s"] for name, row in runs.items()},
        plot_path,
        ylabel="output tokens / s",
        title=(
            f"Speculative decoding, {results['workload']['num_seqs']} sequence(s) "
            f"{harness.machine_summary(results['machine'])}"
        ),
        bar_labels=[
            f"{row['output_tokens_per_s']:.1f}\n{row['speed_vs_plain']:.2f}x"
            for row in runs.values()
        ],
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-seqs", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-drafts", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=checkpoints.CHECKPOINT_CACHE_DIR / "g1-qwen2.5-0.5b-shapes",
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=REPO_ROOT / "bench" / "results" / "speculative_decoding_cpu.json",
    )
    parser.add_argument("--plot", type=Path, default=None, help="default: --output as .png")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    results = run(args)
    workers.publish_results(results, args.output, args.plot, save_plot, table(results), "spec")


if __name__ == "__main__":
    main()
