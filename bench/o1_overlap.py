"""Workload O1: no idle device. vacpack with async scheduling off against on, side by side, one run.

A decode-heavy workload on G1's model (random weights, the exact shapes of Qwen2.5-0.5B,
bfloat16): random-token prompts (lengths uniform in [32, 1024], seeded), greedy, EOS ignored,
many output tokens each. Almost every step is then a decode step whose device work is short, so
the host's per-step work (scheduling, building inputs, reading sampled tokens) is what leaves a
synchronous engine's device idle, and what async scheduling hides behind the device's work.

Configurations, each in its own subprocess (`--worker CONFIG`) so that memory and warm-up are
the same for all, on the same prompts, after a warm-up on other prompts:

- overlap_off: async scheduling off: the host prepares step N+1 after it has read step N.
- overlap_on: async scheduling on: step N+1 is launched before step N is read.
- overlap_on_no_graphs (CUDA only): async scheduling on, CUDA graphs off: the graphs' share.

Full size (the default on CUDA): 256 requests x 512 output tokens. On a CPU the default is
scaled down to 32 requests x 32 tokens with prompts of 32..256 tokens; the flags override
either, and the output says which scale ran. Reported per configuration: output tokens/s, wall
time and the step timeline's summary (device-busy fraction, idle gaps, host prepare and process
ms per step, padded slots); then the speed-up of overlap on over off, whether the greedy outputs
of every configuration are identical to overlap_off's, and the targets. Writes the JSON, a bar
chart, and per configuration the timeline as JSON and as a chart of a middle stretch of steps.

Full run (on a GPU machine; a few minutes):
    python bench/o1_overlap.py
Quick check that everything works:
    python bench/o1_overlap.py --num-prompts 4 --max-tokens 8 --max-prompt-len 64 \
        --output bench/results/tmp/o1_small.json
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import checkpoints
import harness
import workers
from harness import (
    heartbeat,
    machine_description,
    random_token_prompts,
    save_vacpack_timeline,
    vacpack_engine_fields,
)
from o1_report import (
    compare_outputs,
    markdown_table,
    save_plot,
    speedups,
    targets,
    timeline_paths,
)
from o1_workload import (
    CONFIGS,
    CPU_SCALED_WORKLOAD,
    DEFAULT_CONFIGS,
    FULL_WORKLOAD,
    PROMPT_SEED,
    RESULTS_DIR,
    WARMUP_PROMPT_SEED,
    log,
    read_model_config,
    scale_name,
    workload_of,
)
from process_timing import timed_section
from workers import (
    run_catching_errors,
    save_worker_result,
)

# ---------------------------------------------------------------------------- worker


def cpu_kv_cache_bytes(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> int:
    """A CPU KV budget that holds every request at full length at once, plus one sequence of
    the model's full context (the engine's minimum), instead of 40% of the machine's RAM."""
    import torch

    from vacpack.kvcache import kv_bytes_per_token

    config = read_model_config(model_dir)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    bytes_per_token = kv_bytes_per_token(
        config["num_hidden_layers"], config["num_key_value_heads"], head_dim, torch.bfloat16
    )
    page_tokens = 16  # the engine's default block_size: one partly used page per request
    workload_tokens = sum(len(p) + max_tokens + page_tokens for p in prompts)
    return bytes_per_token * (workload_tokens + config["max_position_embeddings"])


def run_config(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    from vacpack import LLM, SamplingParams

    config = CONFIGS[args.worker]
    engine_args: dict[str, Any] = {
        "async_scheduling": config.async_scheduling,
        "enable_cuda_graphs": config.cuda_graphs,
        "attention_backend": args.attention_backend,
    }
    if args.max_num_batched_tokens is not None:
        engine_args["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.device == "cpu":
        engine_args["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(
            args.model_dir, prompts, args.max_tokens
        )
    log(f"{args.worker}: loading the model (not timed)")
    llm = LLM(str(args.model_dir), dtype="bfloat16", device=args.device, **engine_args)
    engine_fields = vacpack_engine_fields(llm)  # builds the engine: KV cache, CUDA graphs
    log(f"{args.worker}: engine {engine_fields}")

    vocab_size = int(read_model_config(args.model_dir)["vocab_size"])
    warmup_prompts = random_token_prompts(
        args.warmup_prompts,
        args.min_prompt_len,
        args.max_prompt_len,
        vocab_size,
        WARMUP_PROMPT_SEED,
    )
    warmup_params = SamplingParams(temperature=0, max_tokens=args.warmup_tokens, ignore_eos=True)
    log(f"{args.worker}: warm-up, {len(warmup_prompts)} prompts (not timed)")
    llm.generate(warmup_prompts, warmup_params, use_tqdm=False)
    timeline = llm.engine.timeline
    timeline.reset()  # the timeline covers the timed run alone

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    engine = llm.engine
    log(f"{args.worker}: generating for {len(prompts)} prompts")
    with (
        heartbeat(args.worker, lambda: f"{engine.state().num_generated_tokens} tokens generated"),
        timed_section() as section,
    ):
        outputs = llm.generate(prompts, params, use_tqdm=False)

    output_token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    num_prompt_tokens = sum(len(p) for p in prompts)
    num_output_tokens = sum(len(o) for o in output_token_ids)
    png_path, json_path = timeline_paths(args.output, args.worker)
    timeline_fields = save_vacpack_timeline(
        timeline,
        png_path,
        json_path,
        title=f"O1 {args.worker} ({config.description}): {len(prompts)} requests x "
        f"{args.max_tokens} tokens, {args.device}",
        max_steps=args.timeline_steps,
    )
    log(f"{args.worker}: {timeline.summary().describe()}")
    return {
        "description": config.description,
        "engine_args": engine_args,
        "engine": engine_fields,
        **section.fields(),
        "num_prompt_tokens": num_prompt_tokens,
        "num_output_tokens": num_output_tokens,
        "output_tokens_per_s": num_output_tokens / section.wall_s,
        "total_tokens_per_s": (num_prompt_tokens + num_output_tokens) / section.wall_s,
        "all_outputs_full_length": all(len(o) == args.max_tokens for o in output_token_ids),
        **timeline_fields,
        # Kept for the comparison across configurations; not copied into the results file.
        "output_token_ids": output_token_ids,
    }


def worker_main(args: argparse.Namespace) -> int:
    vocab_size = int(read_model_config(args.model_dir)["vocab_size"])
    prompts = random_token_prompts(
        args.num_prompts, args.min_prompt_len, args.max_prompt_len, vocab_size, PROMPT_SEED
    )
    result = run_catching_errors(lambda: run_config(args, prompts))
    save_worker_result(result, Path(args.worker_output))
    return 0


# ---------------------------------------------------------------------------- orchestration


# The options a worker gets from the orchestrating run.
WORKER_OPTIONS: tuple[str, ...] = (
    "device", "num_prompts", "min_prompt_len", "max_prompt_len", "max_tokens",
    "warmup_prompts", "warmup_tokens", "attention_backend", "timeline_steps", "model_dir",
    "output", "max_num_batched_tokens",
)  # fmt: skip


def worker_command(args: argparse.Namespace, config: str, worker_output: Path) -> list[str]:
    return workers.worker_command(__file__, config, worker_output, args, WORKER_OPTIONS)


def orchestrate(args: argparse.Namespace) -> int:
    configs_to_run = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = sorted(set(configs_to_run) - set(CONFIGS))
    if unknown:
        raise SystemExit(f"unknown configurations {unknown}; choose from {', '.join(CONFIGS)}")
    model_dir = checkpoints.ensure_qwen2_5_0_5b_shapes_checkpoint(args.model_dir, "o1")
    workload = workload_of(args)
    vocab_size = int(read_model_config(model_dir)["vocab_size"])
    prompts = random_token_prompts(
        args.num_prompts, args.min_prompt_len, args.max_prompt_len, vocab_size, PROMPT_SEED
    )
    scale = scale_name(workload)
    log(f"{args.device}, {scale}: {args.num_prompts} requests x {args.max_tokens} tokens")

    budget = workers.RunBudget(args.time_budget_s)
    configs: dict[str, dict[str, Any]] = {}
    for index, name in enumerate(configs_to_run):
        log(f"configuration {index + 1}/{len(configs_to_run)}: {name}")
        configs[name] = workers.run_worker_within(
            budget,
            args.worker_timeout_s,
            lambda worker_output, name=name: worker_command(args, name, worker_output),
            name,
            "o1",
        )
    agreement = compare_outputs(configs)
    ratios = speedups(configs)
    results: dict[str, Any] = {
        "workload": {
            "name": "O1",
            "model": "random weights, Qwen2.5-0.5B shapes, bfloat16",
            "model_dir": str(model_dir),
            "device": args.device,
            "scale": scale,
            "num_prompts": args.num_prompts,
            "min_prompt_len": args.min_prompt_len,
            "max_prompt_len": args.max_prompt_len,
            "prompt_seed": PROMPT_SEED,
            "num_prompt_tokens": sum(len(p) for p in prompts),
            "max_tokens": args.max_tokens,
            "greedy": True,
            "ignore_eos": True,
            "warmup_prompts": args.warmup_prompts,
            "warmup_tokens": args.warmup_tokens,
            "attention_backend": args.attention_backend,
            "max_num_batched_tokens": args.max_num_batched_tokens,
        },
        "machine": machine_description(),
        "configs": configs,
        "speedups": ratios,
        "greedy_agreement": agreement,
        "targets": targets(
            configs, ratios, applies=args.device == "cuda" and workload == FULL_WORKLOAD
        ),
    }
    workers.publish_results(
        results,
        args.output,
        None,
        save_plot,
        markdown_table(results),
        "o1",
    )
    return 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Workload flags left out take the device's default: "
        f"CUDA {FULL_WORKLOAD}, CPU {CPU_SCALED_WORKLOAD}.",
    )
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument(
        "--configs",
        default=None,
        help=f"comma-separated subset of {', '.join(CONFIGS)} "
        "(default: all on CUDA, the first two on CPU)",
    )
    parser.add_argument("--num-prompts", type=int, default=None, help="requests")
    parser.add_argument("--min-prompt-len", type=int, default=None)
    parser.add_argument("--max-prompt-len", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=None, help="output tokens per request")
    parser.add_argument("--warmup-prompts", type=int, default=8, help="untimed, other prompts")
    parser.add_argument("--warmup-tokens", type=int, default=16, help="output tokens each")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument(
        "--timeline-steps", type=int, default=40, help="consecutive steps each timeline chart draws"
    )
    parser.add_argument(
        "--worker-timeout-s", type=float, default=None, help="kill a configuration running longer"
    )
    parser.add_argument(
        "--time-budget-s",
        type=float,
        default=None,
        help="the whole run's budget: a configuration gets at most what is left of it",
    )
    parser.add_argument("--model-dir", type=Path, default=checkpoints.QWEN2_5_0_5B_SHAPES_DIR)
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help="results JSON (default bench/results/o1_DEVICE.json); the bar chart and the "
        "timelines go beside it",
    )
    # Internal: run one configuration in this process and write its result to --worker-output.
    parser.add_argument("--worker", choices=list(CONFIGS), help=argparse.SUPPRESS)
    parser.add_argument("--worker-output", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    args.device = harness.resolve_device(args.device)
    default = FULL_WORKLOAD if args.device.startswith("cuda") else CPU_SCALED_WORKLOAD
    for field in ("num_prompts", "min_prompt_len", "max_prompt_len", "max_tokens"):
        if getattr(args, field) is None:
            setattr(args, field, getattr(default, field))
    if args.configs is None:
        args.configs = ",".join(
            DEFAULT_CONFIGS["cuda" if args.device.startswith("cuda") else "cpu"]
        )
    if args.output is None:
        args.output = RESULTS_DIR / f"o1_{args.device.split(':')[0]}.json"
    if not 1 <= args.min_prompt_len <= args.max_prompt_len:
        parser.error("need 1 <= --min-prompt-len <= --max-prompt-len")
    if min(args.num_prompts, args.max_tokens, args.warmup_prompts, args.warmup_tokens) < 1:
        parser.error("request counts and token counts must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return worker_main(args)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
