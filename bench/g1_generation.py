"""Workload G1: vacpack against transformers' generate and generate_batch, side by side, one run.

G1 is a random-weight model with the exact shapes of Qwen2.5-0.5B (or, with `--shape
qwen2.5-1.5b`, of Qwen2.5-1.5B) in bfloat16, fed random-token prompts (lengths uniform in
[32, 1024], seeded), 128 greedy output tokens each with EOS ignored. Each system runs in its own
subprocess (`--worker SYSTEM`), so one system's memory never slows the next and each gets its
own peak memory; each first runs a few other prompts, untimed, so that first-call costs (CUDA
graph capture, kernel compilation, allocator growth) stay out of the measurement. The same run
measures this machine's bfloat16 matmul peak at the model's prefill shapes (CUDA events on a
GPU), from which vacpack's prefill MFU is derived, and saves vacpack's step timeline.

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
import dataclasses
import importlib.util
import inspect
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
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
    random_token_prompts,
    run_catching_errors,
    save_bar_chart,
    save_vacpack_timeline,
    save_worker_result,
    timed_section,
    vacpack_engine_fields,
)

SYSTEMS: tuple[str, ...] = ("vacpack", "hf_generate", "hf_generate_batch", "hf_generate_batch_auto")
# On a CPU generate_batch has no CUDA graphs and no async batching: its own choice is the same
# run as hf_generate_batch, so it is left out there.
DEFAULT_SYSTEMS: dict[str, tuple[str, ...]] = {
    "cpu": ("vacpack", "hf_generate", "hf_generate_batch"),
    "cuda": SYSTEMS,
}
# Not a system: the matmul-peak measurement, run in a worker of its own like the systems.
MATMUL_PEAK_WORKER = "matmul_peak"
BASELINES: tuple[str, ...] = ("hf_generate", "hf_generate_batch", "hf_generate_batch_auto")
GENERATE_BATCH_SYSTEMS: tuple[str, ...] = ("hf_generate_batch", "hf_generate_batch_auto")

SHAPES: tuple[str, ...] = tuple(harness.MODEL_SHAPE_DIRS)
SHAPE_LABELS: dict[str, str] = {"qwen2.5-0.5b": "Qwen2.5-0.5B", "qwen2.5-1.5b": "Qwen2.5-1.5B"}
RESULTS_DIR = harness.REPO_ROOT / "bench" / "results"

PROMPT_SEED = 0
# The warm-up's prompts come from another seed, so the prefix cache gives the timed run nothing.
WARMUP_PROMPT_SEED = 1
WARMUP_NUM_PROMPTS = 4
WARMUP_OUTPUT_TOKENS = 8
PAD_TOKEN_ID = 0
# transformers' own default page size for continuous batching.
HF_CB_PAGE_SIZE_TOKENS = 256
# What generate_batch settled on, read back from its manager after the warm-up.
HF_CB_RESOLVED_FIELDS: tuple[str, ...] = (
    "use_cuda_graph",
    "use_async_batching",
    "max_batch_tokens",
    "num_blocks",
    "max_requests_per_batch",
    "max_blocks_per_request",
    "q_padding_interval_size",
    "kv_padding_interval_size",
    "default_compile_level",
)

# A GPU's bf16 peak is usually quoted for a large square product; measured beside the model's
# own shapes for reference, never used for the MFU.
CUDA_REFERENCE_MATMUL_SIZE = 8192
# vacpack's timeline chart: the run's first steps, where the prefill steps are.
TIMELINE_STEPS = 48

# The targets for the CUDA run.
TARGET_SPEEDUP_OVER_GENERATE_BATCH = 3.0
TARGET_PREFILL_MFU = 0.6


# ---------------------------------------------------------------------------- workload


def log(message: str) -> None:
    harness.log(message, "g1")


def make_prompts(
    num_prompts: int, min_prompt_len: int, max_prompt_len: int, vocab_size: int
) -> list[list[int]]:
    return random_token_prompts(
        num_prompts, min_prompt_len, max_prompt_len, vocab_size, PROMPT_SEED
    )


def make_warmup_prompts(args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    return random_token_prompts(
        WARMUP_NUM_PROMPTS, args.min_prompt_len, args.max_prompt_len, vocab_size, WARMUP_PROMPT_SEED
    )


def read_model_config(model_dir: Path) -> dict[str, Any]:
    return json.loads((model_dir / "config.json").read_text())


def is_cuda(device: str) -> bool:
    return device.startswith("cuda")


def step_budget_tokens(args: argparse.Namespace) -> int:
    """vacpack's step token budget: the flag, else the engine's default for the device."""
    from vacpack.engine.engine import DEFAULT_BATCHED_TOKENS

    if args.max_num_batched_tokens is not None:
        return int(args.max_num_batched_tokens)
    return DEFAULT_BATCHED_TOKENS["cuda" if is_cuda(args.device) else "cpu"]


def matmul_peak_shapes(config: dict[str, Any]) -> list[tuple[int, int]]:
    """(in_features, out_features) of the model's big prefill matmuls: fused gate+up, down,
    fused qkv."""
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    qkv_features = (config["num_attention_heads"] + 2 * config["num_key_value_heads"]) * head_dim
    return [
        (hidden, 2 * config["intermediate_size"]),
        (config["intermediate_size"], hidden),
        (hidden, qkv_features),
    ]


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


def timeline_paths(output_path: Path) -> tuple[Path, Path]:
    """Where vacpack's timeline chart and timeline JSON go, beside the results file."""
    stem = output_path.with_suffix("")
    return (
        stem.with_name(f"{stem.name}_vacpack_timeline.png"),
        stem.with_name(f"{stem.name}_vacpack_timeline.json"),
    )


def run_vacpack(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    from vacpack import LLM, SamplingParams

    engine_args: dict[str, Any] = {}
    if args.max_num_batched_tokens is not None:
        engine_args["max_num_batched_tokens"] = args.max_num_batched_tokens
    log("vacpack: loading the model (not timed)")
    llm = LLM(str(args.model_dir), dtype="bfloat16", device=args.device, **engine_args)
    engine_fields = vacpack_engine_fields(llm)  # builds the engine: KV cache, CUDA graphs
    log(f"vacpack: engine {engine_fields}")
    if args.warmup:
        log(f"vacpack: warm-up, {WARMUP_NUM_PROMPTS} other prompts (not timed)")
        vocab_size = int(read_model_config(args.model_dir)["vocab_size"])
        warmup_params = SamplingParams(
            temperature=0, max_tokens=WARMUP_OUTPUT_TOKENS, ignore_eos=True
        )
        llm.generate(make_warmup_prompts(args, vocab_size), warmup_params, use_tqdm=False)
    timeline, stats = llm.engine.timeline, llm.engine.stats
    timeline.reset()  # the timeline covers the timed run alone
    num_preemptions_before = stats.num_preemptions
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    log(f"vacpack: generating for {len(prompts)} prompts")

    def status() -> str:
        return f"{stats.num_generated_tokens} tokens generated"

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
            "num_preemptions": stats.num_preemptions - num_preemptions_before,
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
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.bfloat16)
    model = model.to(args.device).eval()
    # No EOS at all: min_new_tokens alone would keep rows going by masking EOS out of the
    # logits, which changes what greedy picks; without an EOS every row simply runs to the end.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD_TOKEN_ID

    def generate(batch_prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        input_ids, attention_mask = left_padded_batch(batch_prompts)
        sequences = model.generate(
            input_ids.to(args.device),
            attention_mask=attention_mask.to(args.device),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
        )
        return sequences[:, input_ids.shape[1] :].tolist()  # .tolist() waits for the device

    batches = [
        prompts[i : i + args.hf_batch_size] for i in range(0, len(prompts), args.hf_batch_size)
    ]
    output_token_lists: list[list[int]] = []
    with torch.inference_mode():
        if args.warmup:
            log(f"hf_generate: warm-up, {WARMUP_NUM_PROMPTS} other prompts (not timed)")
            vocab_size = int(model.config.vocab_size)
            generate(make_warmup_prompts(args, vocab_size), WARMUP_OUTPUT_TOKENS)
        with timed_section() as section:
            start_s = time.perf_counter()  # for the progress lines only
            for batch_index, batch_prompts in enumerate(batches):
                output_token_lists.extend(generate(batch_prompts, args.max_tokens))
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


def hf_cb_fields(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    """The ContinuousBatchingConfig fields this generate_batch system sets."""
    blocks_per_request = math.ceil(
        (max(len(p) for p in prompts) + args.max_tokens) / HF_CB_PAGE_SIZE_TOKENS
    )
    fields: dict[str, Any] = {
        "page_size": HF_CB_PAGE_SIZE_TOKENS,
        # Sized explicitly: on CPU, transformers sizes the cache from RAM, and without psutil it
        # takes 60% of the machine (about 14 GiB here, 25 s just to allocate). A cache that holds
        # every request at full length is what vacpack gets too; the token budget is vacpack's.
        "num_blocks": hf_cb_num_blocks(prompts, args.max_tokens),
        "max_batch_tokens": step_budget_tokens(args),
        # What transformers would infer from this workload's hints. Set here because the
        # manager is built by the warm-up call, whose hints describe only its few requests.
        "max_requests_per_batch": min(len(prompts), 1024),
        "max_blocks_per_request": blocks_per_request + 1 + (blocks_per_request + 1) % 2,
    }
    if args.worker == "hf_generate_batch" and is_cuda(args.device):
        # The reference: generate_batch with its CUDA graphs and async batching on.
        # With sdpa (no flash-attn package installed) transformers leaves both off by itself,
        # which hf_generate_batch_auto measures.
        fields |= {"use_cuda_graph": True, "use_async_batching": True}
    return fields


def hf_cb_config(fields: dict[str, Any]) -> Any:
    """A ContinuousBatchingConfig, refusing a field this transformers version does not have
    (silently dropping it would measure something other than what the results say)."""
    import transformers
    from transformers import ContinuousBatchingConfig

    known = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise RuntimeError(
            f"transformers {transformers.__version__}'s ContinuousBatchingConfig has no {unknown}"
        )
    return ContinuousBatchingConfig(**fields)


def json_ready(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def flash_attention_packages() -> list[str]:
    """Installed packages that generate_batch would switch to (auto_switch_to_flash)."""
    names = ("flash_attn", "flash_attn_interface", "kernels")
    return [name for name in names if importlib.util.find_spec(name) is not None]


def generated_token_lists(outputs: dict[str, Any], num_prompts: int) -> list[list[int]]:
    """generate_batch logs failures instead of raising, and returns what finished, in input
    order: anything missing or failed is an error here."""
    ordered = list(outputs.values())
    errors = [o.error for o in ordered if o.error is not None]
    if len(ordered) != num_prompts or errors:
        raise RuntimeError(
            f"generate_batch finished {len(ordered) - len(errors)} of {num_prompts} requests; "
            f"first error: {errors[0] if errors else 'requests missing from the results'}"
        )
    return [list(o.generated_tokens) for o in ordered]


def run_hf_generate_batch(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, GenerationConfig

    name = args.worker
    log(f"{name}: loading the model (not timed)")
    # transformers 5.23 runs continuous batching with "sdpa", "paged|eager" or flash attention
    # ("paged|sdpa"/"sdpa_paged" are deprecated aliases of sdpa, which now reads the paged cache
    # itself). It switches to flash attention by itself where a flash package is installed.
    model = AutoModelForCausalLM.from_pretrained(
        args.model_dir, dtype=torch.bfloat16, attn_implementation="sdpa"
    )
    model = model.to(args.device).eval()
    # eos_token_id=-1 leaves the request's EOS set empty, so every request runs to max_new_tokens.
    generation_config = GenerationConfig(
        max_new_tokens=args.max_tokens, do_sample=False, eos_token_id=-1, pad_token_id=PAD_TOKEN_ID
    )
    fields = hf_cb_fields(args, prompts)
    batch_kwargs: dict[str, Any] = {
        "generation_config": generation_config,
        "continuous_batching_config": hf_cb_config(fields),
    }
    # A persistent manager lets the warm-up build the cache and capture the CUDA graphs outside
    # the timed call, as vacpack's engine does before its timed run.
    persistent = "persistent_manager" in inspect.signature(model.generate_batch).parameters
    resolved: dict[str, Any] = {}
    if args.warmup and persistent:
        log(f"{name}: warm-up, {WARMUP_NUM_PROMPTS} other prompts (not timed)")
        warmup_prompts = make_warmup_prompts(args, int(model.config.vocab_size))
        warmup_outputs = model.generate_batch(
            inputs=warmup_prompts,
            max_new_tokens=WARMUP_OUTPUT_TOKENS,
            persistent_manager=True,
            **batch_kwargs,
        )
        generated_token_lists(warmup_outputs, len(warmup_prompts))
        manager = getattr(model, "_cached_continuous_batching_manager", None)
        resolved_config = getattr(manager, "continuous_batching_config", None)
        resolved = {
            field: json_ready(getattr(resolved_config, field, None))
            for field in HF_CB_RESOLVED_FIELDS
        }
        log(f"{name}: generate_batch settled on {resolved}")
    if persistent:
        batch_kwargs["persistent_manager"] = args.warmup  # torn down after the timed section
    log(f"{name}: generating for {len(prompts)} prompts")
    with heartbeat(name, lambda: "running"), timed_section() as section:
        outputs = model.generate_batch(inputs=prompts, **batch_kwargs)
    if hasattr(model, "destroy_cached_continuous_batching_manager"):
        model.destroy_cached_continuous_batching_manager()

    result = throughput_fields(
        section, prompts, generated_token_lists(outputs, len(prompts)), args.max_tokens
    )
    result["continuous_batching_config"] = fields
    result["continuous_batching_resolved"] = resolved
    result["warmed_up_outside_timing"] = bool(args.warmup and persistent)
    flash_packages = flash_attention_packages()
    result["attn_implementation"] = (
        "sdpa, or flash attention where transformers switched to it" if flash_packages else "sdpa"
    )
    result["flash_attention_packages"] = flash_packages
    return result


def run_matmul_peak(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    """Best bfloat16 F.linear throughput at the model's own prefill shapes, with as many rows
    as one of vacpack's steps carries."""
    del prompts  # the same worker signature as the systems
    generator = torch.Generator().manual_seed(0)
    num_rows = step_budget_tokens(args)
    per_shape = []
    with timed_section() as section:
        for in_features, out_features in matmul_peak_shapes(read_model_config(args.model_dir)):
            per_shape.append(
                best_linear_tflops(num_rows, in_features, out_features, generator, args.device)
            )
            log(f"matmul peak: {per_shape[-1]['shape']}: {per_shape[-1]['best_tflops']:.3f} TFLOPS")
    result: dict[str, Any] = {
        "device": args.device,
        "timing": "CUDA events" if is_cuda(args.device) else "host clock",
        "per_shape": per_shape,
        "best_tflops": max(s["best_tflops"] for s in per_shape),
        "other_processes_core_share": section.fields()["other_processes_core_share"],
    }
    if is_cuda(args.device):
        size = CUDA_REFERENCE_MATMUL_SIZE
        result["reference_square"] = best_linear_tflops(size, size, size, generator, args.device)
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
    if result.get("all_outputs_full_length") is False:
        # Short outputs would make tokens/s incomparable across systems; say so loudly.
        result["warning"] = f"not every prompt got exactly {args.max_tokens} output tokens"
        log(f"{args.worker}: WARNING: {result['warning']}")
    save_worker_result(result, Path(args.worker_output))
    return 0


# ---------------------------------------------------------------------------- orchestration


# The options a worker gets from the orchestrating run.
WORKER_OPTIONS: tuple[str, ...] = (
    "device", "shape", "num_prompts", "min_prompt_len", "max_prompt_len", "max_tokens",
    "hf_batch_size", "model_dir", "output", "warmup", "max_num_batched_tokens",
)  # fmt: skip


def worker_command(args: argparse.Namespace, worker: str, worker_output: Path) -> list[str]:
    return harness.worker_command(__file__, worker, worker_output, args, WORKER_OPTIONS)


def run_worker(args: argparse.Namespace, worker: str, budget: harness.RunBudget) -> dict[str, Any]:
    return harness.run_worker_within(
        budget,
        args.worker_timeout_s,
        lambda worker_output: worker_command(args, worker, worker_output),
        worker,
        "g1",
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
    device_tflops = flops / vacpack["prefill_device_time_s"] / 1e12
    step_wall_tflops = flops / vacpack["prefill_step_wall_s"] / 1e12
    return {
        "prefill_device_time_s": vacpack["prefill_device_time_s"],
        "prefill_step_wall_s": vacpack["prefill_step_wall_s"],
        "num_prefill_tokens": vacpack["num_prefill_tokens"],
        "prefill_tokens_per_s": vacpack["num_prefill_tokens"] / vacpack["prefill_device_time_s"],
        "prefill_model_flops": flops,
        "prefill_tflops": device_tflops,
        "mfu": device_tflops / peak_tflops if peak_tflops else None,
        "prefill_tflops_step_wall": step_wall_tflops,
        "mfu_step_wall": step_wall_tflops / peak_tflops if peak_tflops else None,
    }


def target_entry(target: float, measured: float | None) -> dict[str, Any]:
    return {
        "target": target,
        "measured": measured,
        "met": measured is not None and measured >= target,
    }


def targets(results: dict[str, Any], applies: bool) -> dict[str, Any]:
    ratios = results["ratios"]
    batch_ratios = [
        ratios[f"vacpack/{n}"] for n in GENERATE_BATCH_SYSTEMS if f"vacpack/{n}" in ratios
    ]
    return {
        # The issue sets them for the GPU run; on a CPU they are shown, not judged.
        "applies": applies,
        "speedup_over_hf_generate_batch": target_entry(
            TARGET_SPEEDUP_OVER_GENERATE_BATCH, ratios.get("vacpack/hf_generate_batch")
        ),
        # Against whichever generate_batch setting ran faster here.
        "speedup_over_fastest_generate_batch": target_entry(
            TARGET_SPEEDUP_OVER_GENERATE_BATCH, min(batch_ratios) if batch_ratios else None
        ),
        "prefill_mfu": target_entry(
            TARGET_PREFILL_MFU, results.get("vacpack_prefill", {}).get("mfu")
        ),
    }


def markdown_table(results: dict[str, Any]) -> str:
    ratios = results["ratios"]
    workload = results["workload"]
    on_gpu = any("peak_gpu_memory_bytes" in s for s in results["systems"].values())
    lines = [
        f"G1 on {workload['device']}: {workload['model']}, {workload['num_prompts']} prompts x "
        f"{workload['max_tokens']} output tokens, prompts {workload['min_prompt_len']}.."
        f"{workload['max_prompt_len']} tokens ({workload['num_prompt_tokens']} in all)",
        "",
        "| system | wall s | output tok/s | total tok/s | vacpack speed-up | peak RSS GiB "
        + ("| peak GPU GiB " if on_gpu else "")
        + "| others' CPU |",
        "|---|---:|---:|---:|---:|---:|" + ("---:|" if on_gpu else "") + "---:|",
    ]
    for name, system in results["systems"].items():
        rss_gib = system.get("peak_rss_bytes", 0) / 2**30
        gpu_cell = f" {system.get('peak_gpu_memory_bytes', 0) / 2**30:.2f} |" if on_gpu else ""
        if "error" in system:
            lines.append(
                f"| {name} | failed: {markdown_cell(system['error'])} | | | | {rss_gib:.2f} |"
                f"{gpu_cell} |"
            )
            continue
        ratio = ratios.get(f"vacpack/{name}")
        ratio_text = "—" if name == "vacpack" else (f"{ratio:.2f}x" if ratio else "n/a")
        lines.append(
            f"| {name} | {system['wall_s']:.2f} | {system['output_tokens_per_s']:.1f} | "
            f"{system['total_tokens_per_s']:.1f} | {ratio_text} | {rss_gib:.2f} |{gpu_cell} "
            f"{system['other_processes_core_share']:.0%} |"
        )
    peak = results.get("bf16_matmul_peak", {})
    if "best_tflops" in peak:
        lines.append(
            f"\nbf16 matmul peak at the model's prefill shapes ({peak['timing']}): "
            f"{peak['best_tflops']:.3f} TFLOPS (others' CPU meanwhile: "
            f"{peak['other_processes_core_share']:.0%})"
        )
        if "reference_square" in peak:
            reference = peak["reference_square"]
            lines.append(f"reference {reference['shape']}: {reference['best_tflops']:.1f} TFLOPS")
    prefill = results.get("vacpack_prefill")
    if prefill:
        mfu_text = f"{prefill['mfu']:.1%}" if prefill["mfu"] is not None else "n/a"
        lines.append(
            f"vacpack prefill: {prefill['num_prefill_tokens']} tokens in "
            f"{prefill['prefill_device_time_s']:.3f} s of device time, "
            f"{prefill['prefill_tflops']:.3f} TFLOPS, MFU {mfu_text}"
            + (
                f" ({prefill['mfu_step_wall']:.1%} over the steps' whole host spans)"
                if prefill["mfu_step_wall"] is not None
                else ""
            )
        )
    vacpack = results["systems"].get("vacpack", {})
    if "timeline_summary" in vacpack:
        summary, engine = vacpack["timeline_summary"], vacpack["engine"]
        lines.append(
            f"vacpack timeline: {summary['num_steps']} steps, device busy "
            f"{summary['device_busy_fraction']:.1%}, mean idle gap "
            f"{summary['mean_idle_gap_s'] * 1e3:.3f} ms; attention "
            f"{engine['attention_backend']}, async scheduling "
            f"{'on' if engine['async_scheduling'] else 'off'}, CUDA graphs "
            f"{'on' if engine['cuda_graphs'] else 'off'}"
        )
    for name in GENERATE_BATCH_SYSTEMS:
        system = results["systems"].get(name, {})
        if "continuous_batching_config" in system:
            lines.append(
                f"{name} settings: asked {system['continuous_batching_config']}; "
                f"transformers settled on {system['continuous_batching_resolved'] or 'n/a'}; "
                f"flash packages: {system['flash_attention_packages'] or 'none'}"
            )
    for name, system in results["systems"].items():
        if "warning" in system:
            lines.append(f"WARNING {name}: {system['warning']}")
    if results.get("first_token_agreement"):
        agreement = ", ".join(f"{k} {v:.0%}" for k, v in results["first_token_agreement"].items())
        lines.append(f"first greedy token matching vacpack's: {agreement}")
    target = results["targets"]
    judged = "" if target["applies"] else " (targets are for the GPU run: not judged)"
    for name, entry in target.items():
        if name == "applies":
            continue
        measured = "n/a" if entry["measured"] is None else f"{entry['measured']:.3f}"
        lines.append(
            f"target {name} >= {entry['target']}: measured {measured}, "
            f"{'met' if entry['met'] else 'not met'}{judged}"
        )
    return "\n".join(lines)


def save_plot(results: dict[str, Any], plot_path: Path) -> None:
    ran = {n: s for n, s in results["systems"].items() if "output_tokens_per_s" in s}
    workload = results["workload"]
    save_bar_chart(
        {name: system["output_tokens_per_s"] for name, system in ran.items()},
        plot_path,
        ylabel="output tokens/s",
        title=f"G1 ({SHAPE_LABELS[workload['shape']]} shapes, bf16, {workload['num_prompts']} "
        f"prompts x {workload['max_tokens']} tokens)\n"
        f"{machine_summary(results['machine'], workload['device'])}",
    )


def orchestrate(args: argparse.Namespace) -> int:
    systems_to_run = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(systems_to_run) - set(SYSTEMS))
    if unknown:
        raise SystemExit(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
    model_dir = harness.ensure_shapes_checkpoint(args.shape, args.model_dir, "g1")
    vocab_size = int(read_model_config(model_dir)["vocab_size"])
    prompts = make_prompts(args.num_prompts, args.min_prompt_len, args.max_prompt_len, vocab_size)
    prompt_lens = [len(p) for p in prompts]
    log(f"{SHAPE_LABELS[args.shape]} shapes on {args.device}: systems {', '.join(systems_to_run)}")

    budget = harness.RunBudget(args.time_budget_s)
    log("measuring the bf16 matmul peak")
    peak = run_worker(args, MATMUL_PEAK_WORKER, budget)
    systems: dict[str, dict[str, Any]] = {}
    for index, name in enumerate(systems_to_run):
        log(f"system {index + 1}/{len(systems_to_run)}: {name}")
        systems[name] = run_worker(args, name, budget)

    results: dict[str, Any] = {
        "workload": {
            "name": "G1",
            "shape": args.shape,
            "model": f"random weights, {SHAPE_LABELS[args.shape]} shapes, bfloat16",
            "model_dir": str(model_dir),
            "device": args.device,
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
        "bf16_matmul_peak": peak,
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

    harness.publish_results(
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
        "--time-budget-s",
        type=float,
        default=None,
        help="the whole run's budget: a system gets at most what is left of it",
    )
    # Internal: run one system in this process and write its result to --worker-output.
    parser.add_argument("--worker", choices=[*SYSTEMS, MATMUL_PEAK_WORKER], help=argparse.SUPPRESS)
    parser.add_argument("--worker-output", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not 1 <= args.min_prompt_len <= args.max_prompt_len:
        parser.error("need 1 <= --min-prompt-len <= --max-prompt-len")

    args.device = harness.resolve_device(args.device)
    device_type = "cuda" if is_cuda(args.device) else "cpu"
    if args.systems is None:
        args.systems = ",".join(DEFAULT_SYSTEMS[device_type])
    if args.model_dir is None:
        args.model_dir = harness.MODEL_SHAPE_DIRS[args.shape]
    if args.output is None:
        args.output = RESULTS_DIR / f"g1_{args.shape}_{device_type}.json"
    if args.plot is None:
        args.plot = args.output.with_suffix(".png")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return worker_main(args)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
