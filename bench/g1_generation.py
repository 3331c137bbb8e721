"""Workload G1: vacpack against transformers' generate and generate_batch, side by side, one run.

G1 is a random-weight model with the exact shapes of Qwen2.5-0.5B in bfloat16, fed random-token
prompts (lengths uniform in [32, 1024], seeded), 128 greedy output tokens each with EOS ignored.
Each system runs in its own subprocess (`--worker SYSTEM`), so one system's memory never slows
the next and each gets its own peak RSS. The same run also measures this machine's bfloat16
matmul peak at the model's prefill shapes, from which vacpack's prefill MFU is derived.

Full run (about 15 minutes on a 2-core CPU):
    python bench/g1_generation.py
Quick check that everything works:
    python bench/g1_generation.py --num-prompts 4 --max-tokens 8 --max-prompt-len 64 \
        --output bench/results/tmp/g1_small.json --plot bench/results/tmp/g1_small.png
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import harness
import torch
from harness import (
    TimedSection,
    best_linear_tflops,
    heartbeat,
    machine_description,
    machine_summary,
    markdown_cell,
    run_catching_errors,
    save_bar_chart,
    save_worker_result,
    timed_section,
)

SYSTEMS: tuple[str, ...] = ("vacpack", "hf_generate", "hf_generate_batch")
# Not a system: the matmul-peak measurement, run in a worker of its own like the systems.
MATMUL_PEAK_WORKER = "matmul_peak"
BASELINES: tuple[str, ...] = ("hf_generate", "hf_generate_batch")

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_DIR = harness.QWEN2_5_0_5B_SHAPES_DIR
DEFAULT_OUTPUT_PATH = REPO_ROOT / "bench" / "results" / "g1_cpu.json"
DEFAULT_PLOT_PATH = REPO_ROOT / "bench" / "results" / "g1_cpu.png"

PROMPT_SEED = 0
PAD_TOKEN_ID = 0
# vacpack's CPU token budget when none is given (DEFAULT_BATCHED_TOKENS in vacpack.engine.engine);
# generate_batch gets the same budget, so neither system wins by batching more tokens per step.
VACPACK_CPU_DEFAULT_BATCHED_TOKENS = 2048
# transformers' own default page size for continuous batching.
HF_CB_PAGE_SIZE_TOKENS = 256

# Rows of the matmul-peak measurement: one step's token budget, as vacpack's CPU prefill runs it.
MATMUL_PEAK_ROWS = 2048
# (in_features, out_features) of the model's big prefill matmuls: fused gate+up, down, fused qkv.
MATMUL_PEAK_SHAPES: tuple[tuple[int, int], ...] = ((896, 9728), (4864, 896), (896, 1152))


# ---------------------------------------------------------------------------- workload


def log(message: str) -> None:
    harness.log(message, "g1")


def make_prompts(
    num_prompts: int, min_prompt_len: int, max_prompt_len: int, vocab_size: int
) -> list[list[int]]:
    """Random token-id prompts; a pure function of its arguments, so every worker gets the same."""
    generator = torch.Generator().manual_seed(PROMPT_SEED)
    prompt_lens = torch.randint(
        min_prompt_len, max_prompt_len + 1, (num_prompts,), generator=generator
    )
    return [
        torch.randint(0, vocab_size, (int(prompt_len),), generator=generator).tolist()
        for prompt_len in prompt_lens
    ]


def read_model_config(model_dir: Path) -> dict[str, Any]:
    return json.loads((model_dir / "config.json").read_text())


def count_non_embedding_params(model_dir: Path) -> int:
    """Parameters outside the embedding and LM head, counted on the meta device (no memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    # named_parameters() yields a tied LM head once, under the embedding's name.
    return sum(
        parameter.numel()
        for name, parameter in model.named_parameters()
        if "embed_tokens" not in name and "lm_head" not in name
    )


def prefill_model_flops(
    *,
    num_non_embedding_params: int,
    num_prefill_tokens: int,
    prompt_lens: list[int],
    num_layers: int,
    attention_hidden_size: int,
    hidden_size: int,
    vocab_size: int,
) -> float:
    """Model FLOPs of prefilling every prompt once: the numerator of prefill MFU.

    - Linear layers: 2 * num_non_embedding_params per prefill token (one multiply-add per weight).
    - Attention: QK^T and PV are each 2 * L^2 * attention_hidden_size FLOPs per layer for a full
      L x L square (attention_hidden_size = heads * head_dim); a causal mask keeps half of it,
      so 4 * num_layers * attention_hidden_size * L^2 / 2 per prompt of length L.
    - LM head: only the last prompt position is sampled, so 2 * hidden_size * vocab_size per prompt.

    Embedding lookups, norms, RoPE and softmax are left out: they are not matmul work.
    """
    linear_flops = 2 * num_non_embedding_params * num_prefill_tokens
    attention_flops = 4 * num_layers * attention_hidden_size * sum(n * n / 2 for n in prompt_lens)
    lm_head_flops = 2 * hidden_size * vocab_size * len(prompt_lens)
    return float(linear_flops + attention_flops + lm_head_flops)


# ---------------------------------------------------------------------------- workers


def throughput_fields(
    section: TimedSection,
    prompts: list[list[int]],
    output_token_lists: list[list[int]],
    max_tokens: int,
) -> dict[str, Any]:
    """The numbers every system reports; only real tokens count (never padding)."""
    wall_s = section.wall_s
    num_prompt_tokens = sum(len(p) for p in prompts)
    num_output_tokens = sum(len(o) for o in output_token_lists)
    num_short_outputs = sum(len(o) != max_tokens for o in output_token_lists)
    return {
        **section.fields(),
        "num_prompt_tokens": num_prompt_tokens,
        "num_output_tokens": num_output_tokens,
        "output_tokens_per_s": num_output_tokens / wall_s,
        "total_tokens_per_s": (num_prompt_tokens + num_output_tokens) / wall_s,
        "all_outputs_full_length": num_short_outputs == 0
        and len(output_token_lists) == len(prompts),
        # Kept for the cross-system agreement check; not copied into the results file.
        "first_output_tokens": [o[0] if o else None for o in output_token_lists],
    }


def run_vacpack(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    from vacpack import LLM, SamplingParams

    engine_args: dict[str, Any] = {}
    if args.max_num_batched_tokens is not None:
        engine_args["max_num_batched_tokens"] = args.max_num_batched_tokens
    log("vacpack: loading the model (not timed)")
    llm = LLM(str(args.model_dir), dtype="bfloat16", device="cpu", **engine_args)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    stats = llm.engine.stats
    log(f"vacpack: generating for {len(prompts)} prompts")

    def status() -> str:
        return f"{stats.num_generated_tokens} tokens generated"

    with heartbeat("vacpack", status), timed_section() as section:
        outputs = llm.generate(prompts, params, use_tqdm=False)

    # A step with more tokens than decodes carries prompt tokens; its whole time counts as
    # prefill time, decodes riding along included, which makes the MFU below a slight undercount.
    prefill_steps = [s for s in stats.steps if s.num_tokens > s.num_decode_tokens]
    result = throughput_fields(
        section, prompts, [list(o.outputs[0].token_ids) for o in outputs], args.max_tokens
    )
    result.update(
        {
            "max_num_batched_tokens": llm.engine.max_num_batched_tokens,
            "num_steps": len(stats.steps),
            "num_preemptions": stats.num_preemptions,
            "prefill_time_s": sum(s.end_s - s.start_s for s in prefill_steps),
            "num_prefill_tokens": sum(s.num_tokens - s.num_decode_tokens for s in prefill_steps),
            "num_prefill_steps": len(prefill_steps),
            "num_decode_tokens_in_prefill_steps": sum(s.num_decode_tokens for s in prefill_steps),
        }
    )
    return result


def left_padded_batch(batch_prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    max_len = max(len(p) for p in batch_prompts)
    input_ids = torch.full((len(batch_prompts), max_len), PAD_TOKEN_ID, dtype=torch.long)
    attention_mask = torch.zeros((len(batch_prompts), max_len), dtype=torch.long)
    for row, prompt in enumerate(batch_prompts):
        input_ids[row, max_len - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, max_len - len(prompt) :] = 1
    return input_ids, attention_mask


def run_hf_generate(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    log("hf_generate: loading the model (not timed)")
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.bfloat16).eval()
    # No EOS at all: min_new_tokens alone would keep rows going by masking EOS out of the
    # logits, which changes what greedy picks; without an EOS every row simply runs to the end.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD_TOKEN_ID
    batches = [
        prompts[i : i + args.hf_batch_size] for i in range(0, len(prompts), args.hf_batch_size)
    ]
    output_token_lists: list[list[int]] = []
    with torch.inference_mode(), timed_section() as section:
        start_s = time.perf_counter()  # for the progress lines only
        for batch_index, batch_prompts in enumerate(batches):
            input_ids, attention_mask = left_padded_batch(batch_prompts)
            sequences = model.generate(
                input_ids,
                attention_mask=attention_mask,
                max_new_tokens=args.max_tokens,
                min_new_tokens=args.max_tokens,
                do_sample=False,
            )
            output_token_lists.extend(sequences[:, input_ids.shape[1] :].tolist())
            log(
                f"hf_generate: batch {batch_index + 1}/{len(batches)} done "
                f"({time.perf_counter() - start_s:.0f} s)"
            )
    result = throughput_fields(section, prompts, output_token_lists, args.max_tokens)
    result["batch_size"] = args.hf_batch_size
    result["attn_implementation"] = model.config._attn_implementation
    return result


def hf_cb_num_blocks(prompts: list[list[int]], max_tokens: int) -> int:
    """Enough cache pages for every request at full length at once, so nothing is ever evicted."""
    return sum(math.ceil((len(p) + max_tokens) / HF_CB_PAGE_SIZE_TOKENS) for p in prompts)


def run_hf_generate_batch(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

    log("hf_generate_batch: loading the model (not timed)")
    # transformers 5.23 runs continuous batching with "sdpa", "paged|eager" or flash attention
    # ("paged|sdpa"/"sdpa_paged" are deprecated aliases of sdpa, which now reads the paged cache
    # itself); flash needs CUDA, so sdpa is the CPU choice.
    model = AutoModelForCausalLM.from_pretrained(
        args.model_dir, dtype=torch.bfloat16, attn_implementation="sdpa"
    ).eval()
    # eos_token_id=-1 leaves the request's EOS set empty, so every request runs to max_new_tokens.
    generation_config = GenerationConfig(
        max_new_tokens=args.max_tokens, do_sample=False, eos_token_id=-1, pad_token_id=PAD_TOKEN_ID
    )
    # Sized explicitly: on CPU, transformers sizes the cache from RAM, and without psutil it
    # takes 60% of the machine (about 14 GiB here, 25 s just to allocate). A cache that holds
    # every request at full length is what vacpack gets too; the token budget matches vacpack's.
    cb_config = ContinuousBatchingConfig(
        page_size=HF_CB_PAGE_SIZE_TOKENS,
        num_blocks=hf_cb_num_blocks(prompts, args.max_tokens),
        max_batch_tokens=args.max_num_batched_tokens or VACPACK_CPU_DEFAULT_BATCHED_TOKENS,
    )
    cb_config_fields = {
        "page_size": cb_config.page_size,
        "num_blocks": cb_config.num_blocks,
        "max_batch_tokens": cb_config.max_batch_tokens,
    }
    log(f"hf_generate_batch: generating for {len(prompts)} prompts")
    with heartbeat("hf_generate_batch", lambda: "running"), timed_section() as section:
        outputs = model.generate_batch(
            inputs=prompts,
            generation_config=generation_config,
            continuous_batching_config=cb_config,
        )

    # generate_batch logs failures instead of raising, and returns what finished, in input order.
    ordered = list(outputs.values())
    errors = [o.error for o in ordered if o.error is not None]
    if len(ordered) != len(prompts) or errors:
        raise RuntimeError(
            f"generate_batch finished {len(ordered) - len(errors)} of {len(prompts)} requests; "
            f"first error: {errors[0] if errors else 'requests missing from the results'}"
        )
    result = throughput_fields(
        section, prompts, [list(o.generated_tokens) for o in ordered], args.max_tokens
    )
    result["continuous_batching_config"] = cb_config_fields
    result["attn_implementation"] = "sdpa"
    return result


def run_matmul_peak(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    """Best bfloat16 F.linear throughput at the model's own prefill shapes."""
    del args, prompts  # the same worker signature as the systems
    generator = torch.Generator().manual_seed(0)
    per_shape = []
    with timed_section() as section:
        for in_features, out_features in MATMUL_PEAK_SHAPES:
            per_shape.append(
                best_linear_tflops(MATMUL_PEAK_ROWS, in_features, out_features, generator)
            )
            log(f"matmul peak: {per_shape[-1]['shape']}: {per_shape[-1]['best_tflops']:.3f} TFLOPS")
    return {
        "per_shape": per_shape,
        "best_tflops": max(s["best_tflops"] for s in per_shape),
        "other_processes_core_share": section.fields()["other_processes_core_share"],
    }


WORKERS: dict[str, Callable[[argparse.Namespace, list[list[int]]], dict[str, Any]]] = {
    "vacpack": run_vacpack,
    "hf_generate": run_hf_generate,
    "hf_generate_batch": run_hf_generate_batch,
    MATMUL_PEAK_WORKER: run_matmul_peak,
}


def worker_main(args: argparse.Namespace) -> int:
    vocab_size = int(read_model_config(args.model_dir)["vocab_size"])
    prompts = make_prompts(args.num_prompts, args.min_prompt_len, args.max_prompt_len, vocab_size)
    result = run_catching_errors(lambda: WORKERS[args.worker](args, prompts))
    if result.get("all_outputs_full_length") is False:
        # Short outputs would make tokens/s incomparable across systems; say so loudly.
        result["warning"] = f"not every prompt got exactly {args.max_tokens} output tokens"
        log(f"{args.worker}: WARNING: {result['warning']}")
    save_worker_result(result, Path(args.worker_output))
    return 0


# ---------------------------------------------------------------------------- orchestration


def worker_command(args: argparse.Namespace, worker: str, worker_output: Path) -> list[str]:
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker", worker,
        "--worker-output", str(worker_output),
        "--num-prompts", str(args.num_prompts),
        "--min-prompt-len", str(args.min_prompt_len),
        "--max-prompt-len", str(args.max_prompt_len),
        "--max-tokens", str(args.max_tokens),
        "--hf-batch-size", str(args.hf_batch_size),
        "--model-dir", str(args.model_dir),
    ]  # fmt: skip
    if args.max_num_batched_tokens is not None:
        command += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    return command


def run_worker(args: argparse.Namespace, worker: str) -> dict[str, Any]:
    return harness.run_worker(
        lambda worker_output: worker_command(args, worker, worker_output), worker, "g1"
    )


def first_token_agreement(systems: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Share of prompts whose first greedy token matches vacpack's: a check that all systems ran
    the same model on the same inputs (later tokens may drift on bfloat16 near-ties)."""
    reference = systems.get("vacpack", {}).get("first_output_tokens")
    agreement = {}
    for name in BASELINES:
        other = systems.get(name, {}).get("first_output_tokens")
        if reference and other and len(other) == len(reference):
            agreement[name] = sum(a == b for a, b in zip(reference, other, strict=True)) / len(
                reference
            )
    return agreement


def speedup_ratios(systems: dict[str, dict[str, Any]]) -> dict[str, float]:
    """vacpack's output tokens/s over each baseline's; every system counts the same tokens, so
    the total-tokens/s ratio and the inverse wall-time ratio are the same number."""
    vacpack = systems.get("vacpack", {})
    ratios = {}
    for name in BASELINES:
        baseline = systems.get(name, {})
        if "output_tokens_per_s" in vacpack and "output_tokens_per_s" in baseline:
            ratios[f"vacpack/{name}"] = (
                vacpack["output_tokens_per_s"] / baseline["output_tokens_per_s"]
            )
    return ratios


def vacpack_prefill_mfu(
    vacpack: dict[str, Any], model_dir: Path, prompts: list[list[int]], peak_tflops: float | None
) -> dict[str, Any]:
    config = read_model_config(model_dir)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    flops = prefill_model_flops(
        num_non_embedding_params=count_non_embedding_params(model_dir),
        num_prefill_tokens=vacpack["num_prefill_tokens"],
        prompt_lens=[len(p) for p in prompts],
        num_layers=config["num_hidden_layers"],
        attention_hidden_size=config["num_attention_heads"] * head_dim,
        hidden_size=config["hidden_size"],
        vocab_size=config["vocab_size"],
    )
    achieved_tflops = flops / vacpack["prefill_time_s"] / 1e12
    return {
        "prefill_time_s": vacpack["prefill_time_s"],
        "num_prefill_tokens": vacpack["num_prefill_tokens"],
        "prefill_tokens_per_s": vacpack["num_prefill_tokens"] / vacpack["prefill_time_s"],
        "prefill_model_flops": flops,
        "prefill_tflops": achieved_tflops,
        "mfu": achieved_tflops / peak_tflops if peak_tflops else None,
    }


def markdown_table(results: dict[str, Any]) -> str:
    ratios = results["ratios"]
    lines = [
        "| system | wall s | output tok/s | total tok/s | vacpack speed-up | peak RSS GiB "
        "| others' CPU |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, system in results["systems"].items():
        rss_gib = system.get("peak_rss_bytes", 0) / 2**30
        if "error" in system:
            lines.append(
                f"| {name} | failed: {markdown_cell(system['error'])} | | | | {rss_gib:.2f} | |"
            )
            continue
        ratio = ratios.get(f"vacpack/{name}")
        ratio_text = "—" if name == "vacpack" else (f"{ratio:.2f}x" if ratio else "n/a")
        lines.append(
            f"| {name} | {system['wall_s']:.1f} | {system['output_tokens_per_s']:.1f} | "
            f"{system['total_tokens_per_s']:.1f} | {ratio_text} | {rss_gib:.2f} | "
            f"{system['other_processes_core_share']:.0%} |"
        )
    peak = results.get("bf16_matmul_peak", {})
    if "best_tflops" in peak:
        lines.append(
            f"\nbf16 matmul peak: {peak['best_tflops']:.3f} TFLOPS "
            f"(others' CPU meanwhile: {peak['other_processes_core_share']:.0%})"
        )
    prefill = results.get("vacpack_prefill")
    if prefill:
        mfu_text = f"{prefill['mfu']:.1%}" if prefill["mfu"] is not None else "n/a"
        lines.append(
            f"vacpack prefill: {prefill['num_prefill_tokens']} tokens in "
            f"{prefill['prefill_time_s']:.2f} s, {prefill['prefill_tflops']:.3f} TFLOPS, "
            f"MFU {mfu_text}"
        )
    for name, system in results["systems"].items():
        if "warning" in system:
            lines.append(f"WARNING {name}: {system['warning']}")
    if results.get("first_token_agreement"):
        agreement = ", ".join(f"{k} {v:.0%}" for k, v in results["first_token_agreement"].items())
        lines.append(f"first greedy token matching vacpack's: {agreement}")
    return "\n".join(lines)


def save_plot(results: dict[str, Any], plot_path: Path) -> None:
    ran = {n: s for n, s in results["systems"].items() if "output_tokens_per_s" in s}
    workload = results["workload"]
    save_bar_chart(
        {name: system["output_tokens_per_s"] for name, system in ran.items()},
        plot_path,
        ylabel="output tokens/s",
        title=f"G1 (Qwen2.5-0.5B shapes, bf16, {workload['num_prompts']} prompts x "
        f"{workload['max_tokens']} tokens)\n{machine_summary(results['machine'])}",
    )


def orchestrate(args: argparse.Namespace) -> int:
    systems_to_run = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(systems_to_run) - set(SYSTEMS))
    if unknown:
        raise SystemExit(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
    model_dir = harness.ensure_qwen2_5_0_5b_shapes_checkpoint(args.model_dir, "g1")
    vocab_size = int(read_model_config(model_dir)["vocab_size"])
    prompts = make_prompts(args.num_prompts, args.min_prompt_len, args.max_prompt_len, vocab_size)
    prompt_lens = [len(p) for p in prompts]

    log("measuring the bf16 matmul peak")
    peak = run_worker(args, MATMUL_PEAK_WORKER)
    systems: dict[str, dict[str, Any]] = {}
    for index, name in enumerate(systems_to_run):
        log(f"system {index + 1}/{len(systems_to_run)}: {name}")
        systems[name] = run_worker(args, name)

    results: dict[str, Any] = {
        "workload": {
            "name": "G1",
            "model": "random weights, Qwen2.5-0.5B shapes, bfloat16",
            "model_dir": str(model_dir),
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
        },
        "machine": machine_description(),
        "bf16_matmul_peak": peak,
        "systems": systems,
        "ratios": speedup_ratios(systems),
        "first_token_agreement": first_token_agreement(systems),
    }
    if "prefill_time_s" in systems.get("vacpack", {}):
        results["vacpack_prefill"] = vacpack_prefill_mfu(
            systems["vacpack"], model_dir, prompts, peak.get("best_tflops")
        )
    for system in systems.values():
        system.pop("first_output_tokens", None)

    harness.publish_results(
        results, args.output, args.plot, save_plot, markdown_table(results), "g1"
    )
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--min-prompt-len", type=int, default=32)
    parser.add_argument("--max-prompt-len", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens per prompt")
    parser.add_argument("--hf-batch-size", type=int, default=16, help="hf_generate's batch size")
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT_PATH)
    parser.add_argument("--plot", type=Path, default=DEFAULT_PLOT_PATH)
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="vacpack's step token budget (and generate_batch's); default vacpack's own",
    )
    # Internal: run one system in this process and write its result to --worker-output.
    parser.add_argument("--worker", choices=[*SYSTEMS, MATMUL_PEAK_WORKER], help=argparse.SUPPRESS)
    parser.add_argument("--worker-output", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not 1 <= args.min_prompt_len <= args.max_prompt_len:
        parser.error("need 1 <= --min-prompt-len <= --max-prompt-len")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return worker_main(args)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
