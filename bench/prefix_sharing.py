"""Prefix caching on vs off, side by side in one run: a shared system prompt, and multi-choice
scoring after a shared few-shot context.

Both on a random-weight model with the exact shapes of Qwen2.5-0.5B in bfloat16 (`--dtype
float32` for CPUs whose bf16 matmuls are slow; G1's checkpoint), random-token prompts (seed 0):

- shared_prompt: requests sharing a 1,024-token system prompt, each with a unique suffix of
  32..128 tokens, 64 greedy output tokens each (EOS ignored). 128 requests (the issue's number).
- multiple_choice: questions with a 600-token few-shot context and 4 continuations of 5..30
  tokens, cut from the bundled English text (random token ids would not survive a round trip
  through the text a harness sends), scored with `LLM.loglikelihood(contexts, continuations)`.
  250 questions on a GPU; on this 2-core CPU the default is 50 (the off side recomputes every
  context: ~2,500 s for 250).

Each (workload, cache setting) runs in its own subprocess. Reports end-to-end throughput, the
prefill tokens actually computed, the cache hit rate, and the on/off ratios. With `--vllm` (the
default) vLLM's CPU build runs shared_prompt too, prefix caching on, in its own environment
(installed by `make bench`; bench/prefix_vllm.py), and the table shows vacpack's speed-up over it.

Full run (about 10 minutes on a 2-core CPU):
    python bench/prefix_sharing.py
Quick check:
    python bench/prefix_sharing.py --num-requests 4 --system-len 64 --max-tokens 4 \\
        --num-questions 3 --context-len 64 --output bench/results/tmp/prefix.json \\
        --plot bench/results/tmp/prefix.png
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import checkpoints
import harness
import process_timing
import torch
import vllm_cpu
import workers
from prefix_vllm import VLLM_SYSTEM, run_vllm_shared_prompt

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_DIR = REPO_ROOT / "bench" / ".cache" / "g1-qwen2.5-0.5b-shapes"
WORKLOADS = ("shared_prompt", "multiple_choice")


def log(message: str) -> None:
    harness.log(message, "prefix")


def shared_prompt_requests(args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    system = torch.randint(0, vocab_size, (args.system_len,), generator=generator).tolist()
    suffix_lens = torch.randint(32, 129, (args.num_requests,), generator=generator).tolist()
    return [
        system + torch.randint(0, vocab_size, (n,), generator=generator).tolist()
        for n in suffix_lens
    ]


def multiple_choice_items(args: argparse.Namespace, tokenizer: Any) -> tuple[list[str], list[str]]:
    """Few-shot contexts and answers cut from the bundled English text, as a harness sends
    them: each context about context_len tokens, each answer 5..30 tokens."""
    from vacpack.testing.tiny_models import TOKENIZER_CORPUS_PATH

    corpus_ids = tokenizer.encode(TOKENIZER_CORPUS_PATH.read_text(encoding="utf-8"))
    generator = torch.Generator().manual_seed(0)
    contexts, continuations = [], []
    for _ in range(args.num_questions):
        start = int(torch.randint(0, len(corpus_ids) - args.context_len, (1,), generator=generator))
        context = tokenizer.decode(corpus_ids[start : start + args.context_len])
        for n in torch.randint(5, 31, (4,), generator=generator).tolist():
            at = int(torch.randint(0, len(corpus_ids) - n, (1,), generator=generator))
            contexts.append(context)
            continuations.append(" " + tokenizer.decode(corpus_ids[at : at + n]).strip())
    return contexts, continuations


def run_worker(args: argparse.Namespace) -> dict[str, Any]:
    from vacpack import LLM, SamplingParams

    enable = args.cache == "on"
    llm = LLM(str(args.model_dir), dtype=args.dtype, device="cpu", enable_prefix_caching=enable)
    vocab_size = llm.loaded.config.vocab_size
    if args.worker == "shared_prompt":
        prompts = shared_prompt_requests(args, vocab_size)
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        llm.engine.timeline.reset()  # the timeline covers the timed run alone
        with process_timing.timed_section() as section:
            outputs = llm.generate(prompts, params, use_tqdm=False)
        steps = llm.engine.timeline.steps
        num_output = sum(len(o.outputs[0].token_ids) for o in outputs)
        num_prompt = sum(len(p) for p in prompts)
        return {
            **section.fields(),
            "num_requests": len(prompts),
            "num_prompt_tokens": num_prompt,
            "num_output_tokens": num_output,
            "output_tokens_per_s": num_output / section.wall_s,
            "total_tokens_per_s": (num_prompt + num_output) / section.wall_s,
            "prefill_tokens_computed": sum(s.num_tokens - s.num_decode_tokens for s in steps),
            "cache_hit_rate": llm.engine.state().prefix_cache_hit_rate,
        }
    context_texts, continuation_texts = multiple_choice_items(args, llm.get_tokenizer())
    llm.loglikelihood(["warm up"], [" now"], use_tqdm=False)  # also measures the bin budget
    engine_tokens_before = llm.engine.state().num_processed_tokens if enable else 0
    with process_timing.timed_section() as section:
        results = llm.loglikelihood(context_texts, continuation_texts, use_tqdm=False)
    if enable:
        computed = llm.engine.state().num_processed_tokens - engine_tokens_before
    else:
        report = llm.corpus_runner.last_report
        computed = report.num_real_tokens
    return {
        **section.fields(),
        "num_questions": args.num_questions,
        "num_scored": len(results),
        "scored_per_s": len(results) / section.wall_s,
        "tokens_computed": computed,
        "logprobs": [r.logprob for r in results],
    }


def orchestrate(args: argparse.Namespace) -> int:
    checkpoints.ensure_qwen2_5_0_5b_shapes_checkpoint(args.model_dir, "prefix")
    results: dict[str, Any] = {
        "machine": harness.machine_description(),
        "dtype": args.dtype,
        "workloads": {},
    }
    for workload in args.workloads.split(","):
        runs = {}
        for cache in args.caches.split(","):
            log(f"{workload}, prefix cache {cache}")
            runs[cache] = workers.run_worker(
                lambda output, w=workload, c=cache: worker_command(args, w, c, output),
                f"{workload}/{cache}",
                "prefix",
            )
        results["workloads"][workload] = summarize(workload, runs)
        if workload == "shared_prompt" and args.vllm:
            add_vllm_run(args, results["workloads"][workload])
    results["settings"] = {k: str(v) for k, v in vars(args).items()}
    workers.publish_results(
        results, args.output, args.plot, save_plot, markdown_table(results), "prefix"
    )
    return 0


def add_vllm_run(args: argparse.Namespace, summary: dict[str, Any]) -> None:
    """vLLM CPU on the same requests, and vacpack's speed-up over it (both caching prefixes)."""
    log(f"shared_prompt, {VLLM_SYSTEM}, prefix cache on")
    vocab_size = int(json.loads((args.model_dir / "config.json").read_text())["vocab_size"])
    prompts = shared_prompt_requests(args, vocab_size)
    run = run_vllm_shared_prompt(
        args.model_dir, prompts, args.max_tokens, args.vllm_kv_cache_gib, args.dtype
    )
    summary[VLLM_SYSTEM] = run
    if "wall_s" in run and "wall_s" in summary["on"]:
        summary[f"vacpack_on/{VLLM_SYSTEM}"] = run["wall_s"] / summary["on"]["wall_s"]


def summarize(workload: str, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    if set(runs) != {"off", "on"}:  # one setting alone (--caches): nothing to compare
        return dict(runs)
    off, on = runs["off"], runs["on"]
    if "error" in off or "error" in on:
        return {"off": off, "on": on}
    summary: dict[str, Any] = {"off": off, "on": on, "speedup": off["wall_s"] / on["wall_s"]}
    if workload == "shared_prompt":
        summary["prefill_tokens_cut"] = (
            1 - on["prefill_tokens_computed"] / off["prefill_tokens_computed"]
        )
        summary["targets"] = {
            "speedup >= 4x": summary["speedup"] >= 4,
            "prefill cut >= 85%": summary["prefill_tokens_cut"] >= 0.85,
        }
    else:
        differences = [
            abs(a - b) for a, b in zip(off.pop("logprobs"), on.pop("logprobs"), strict=True)
        ]
        summary["max_abs_logprob_difference"] = max(differences)
        summary["targets"] = {"speedup >= 3x": summary["speedup"] >= 3}
    return summary


def markdown_table(results: dict[str, Any]) -> str:
    lines = [
        "| workload | cache | wall s | throughput | tokens computed | on/off speed-up |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for workload, summary in results["workloads"].items():
        for cache in ("off", "on"):
            run = summary.get(cache)
            if run is None:
                continue
            if "error" in run:
                error = harness.markdown_cell(run["error"])
                lines.append(f"| {workload} | {cache} | failed: {error} | | | |")
                continue
            if workload == "shared_prompt":
                rate, computed = (
                    f"{run['output_tokens_per_s']:.1f} out tok/s",
                    run["prefill_tokens_computed"],
                )
            else:
                rate, computed = f"{run['scored_per_s']:.2f} choices/s", run["tokens_computed"]
            show_speedup = cache == "on" and "speedup" in summary
            speedup = f"{summary['speedup']:.2f}x" if show_speedup else ""
            wall = f"{run['wall_s']:.1f}"
            lines.append(f"| {workload} | {cache} | {wall} | {rate} | {computed:,} | {speedup} |")
        vllm = summary.get(VLLM_SYSTEM)
        if vllm is not None and "error" in vllm:
            lines.append(
                f"| {workload} | {VLLM_SYSTEM}, on | failed: "
                f"{harness.markdown_cell(vllm['error'])} | | | |"
            )
        elif vllm is not None:
            ratio = summary.get(f"vacpack_on/{VLLM_SYSTEM}")
            rate = f"{vllm['output_tokens_per_s']:.1f} out tok/s"
            lines.append(
                f"| {workload} | {VLLM_SYSTEM}, on | {vllm['wall_s']:.1f} | {rate} | "
                f"{vllm['prefill_tokens_computed']:,} | "
                f"vacpack on: {f'{ratio:.2f}x' if ratio else 'n/a'} |"
            )
    return "\n".join(lines)


def save_plot(results: dict[str, Any], plot_path: Path) -> None:
    values = {
        f"{workload}\ncache {cache}": summary[cache]["wall_s"]
        for workload, summary in results["workloads"].items()
        for cache in ("off", "on")
        if "wall_s" in summary.get(cache, {})
    }
    for workload, summary in results["workloads"].items():
        if "wall_s" in summary.get(VLLM_SYSTEM, {}):
            values[f"{workload}\n{VLLM_SYSTEM}, on"] = summary[VLLM_SYSTEM]["wall_s"]
    machine = harness.machine_summary(results["machine"])
    harness.save_bar_chart(
        values,
        plot_path,
        ylabel="wall seconds (lower is better)",
        title=f"Prefix caching off vs on, Qwen2.5-0.5B shapes, {results['dtype']}\n{machine}",
    )


# The options a worker gets from the orchestrating run.
WORKER_OPTIONS: tuple[str, ...] = (
    "model_dir",
    "dtype",
    "num_requests",
    "system_len",
    "max_tokens",
    "num_questions",
    "context_len",
)


def worker_command(args: argparse.Namespace, workload: str, cache: str, output: Path) -> list[str]:
    command = workers.worker_command(__file__, workload, output, args, WORKER_OPTIONS)
    return [*command, "--cache", cache]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        default="bfloat16",
        help="both systems' dtype (float32 where this CPU's bf16 matmuls are slow)",
    )
    parser.add_argument(
        "--caches",
        default="off,on",
        help="the prefix-cache settings vacpack runs (on alone skips the slow uncached run)",
    )
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--system-len", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-questions", type=int, default=50)
    parser.add_argument("--context-len", type=int, default=600)
    parser.add_argument("--output", type=Path, default=REPO_ROOT / "bench/results/prefix_cpu.json")
    parser.add_argument("--plot", type=Path, default=None, help="default: --output as .png")
    parser.add_argument(
        "--vllm",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run shared_prompt on vLLM CPU (its own environment, from `make bench`)",
    )
    parser.add_argument(
        "--vllm-kv-cache-gib",
        type=float,
        default=vllm_cpu.DEFAULT_KV_CACHE_GIB,
        help="vLLM CPU's KV cache size",
    )
    parser.add_argument("--worker", choices=WORKLOADS, help=argparse.SUPPRESS)
    parser.add_argument("--cache", choices=["on", "off"], help=argparse.SUPPRESS)
    parser.add_argument("--worker-output", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        start_s = time.perf_counter()
        result = workers.run_catching_errors(lambda: run_worker(args))
        log(f"{args.worker}/{args.cache}: done in {time.perf_counter() - start_s:.0f} s")
        workers.save_worker_result(result, args.worker_output)
        return 0
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
