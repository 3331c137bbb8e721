"""G1's workload: the systems, prompts, seeds and targets, and the numbers every system
reports (throughput, prefill FLOPs). Shared by the orchestrator, its workers and the report."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import checkpoints
import harness
import torch
from harness import random_token_prompts
from process_timing import TimedSection

SYSTEMS: tuple[str, ...] = (
    "vacpack", "hf_generate", "hf_generate_batch", "hf_generate_batch_auto", "vllm_cpu",
)  # fmt: skip
# On a CPU generate_batch has no CUDA graphs and no async batching: its own choice is the same
# run as hf_generate_batch, so it is left out there. vllm_cpu is vLLM's CPU build, in its own
# environment (bench/vllm_cpu.py).
DEFAULT_SYSTEMS: dict[str, tuple[str, ...]] = {
    "cpu": ("vacpack", "hf_generate", "hf_generate_batch", "vllm_cpu"),
    "cuda": ("vacpack", "hf_generate", "hf_generate_batch", "hf_generate_batch_auto"),
}
# Not a system: the matmul-peak measurement, run in a worker of its own like the systems.
MATMUL_PEAK_WORKER = "matmul_peak"
BASELINES: tuple[str, ...] = (
    "hf_generate", "hf_generate_batch", "hf_generate_batch_auto", "vllm_cpu",
)  # fmt: skip
GENERATE_BATCH_SYSTEMS: tuple[str, ...] = ("hf_generate_batch", "hf_generate_batch_auto")

SHAPES: tuple[str, ...] = tuple(checkpoints.MODEL_SHAPE_DIRS)
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
    intermediate_size: int,
    vocab_size: int,
) -> float:
    """Model FLOPs of prefilling every prompt once: the numerator of prefill MFU. What
    generation needs, not what an engine happens to run:

    - Linear layers: 2 * num_non_embedding_params per prefill token (one multiply-add per weight),
      except the last layer past its attention (its output projection and gated MLP), which only
      a prompt's last position needs.
    - Attention: QK^T and PV are each 2 * L^2 * attention_hidden_size FLOPs per layer for a full
      L x L square (attention_hidden_size = heads * head_dim); a causal mask keeps half of it,
      so 4 * num_layers * attention_hidden_size * L^2 / 2 per prompt of length L.
    - LM head: only the last prompt position is sampled, so 2 * hidden_size * vocab_size per prompt.

    Embedding lookups, norms, RoPE and softmax are left out: they are not matmul work.
    """
    last_layer_tail_params = (
        attention_hidden_size * hidden_size + 3 * hidden_size * intermediate_size
    )
    unread_rows = num_prefill_tokens - len(prompt_lens)
    linear_flops = 2 * num_non_embedding_params * num_prefill_tokens
    linear_flops -= 2 * last_layer_tail_params * max(unread_rows, 0)
    attention_flops = 4 * num_layers * attention_hidden_size * sum(n * n / 2 for n in prompt_lens)
    lm_head_flops = 2 * hidden_size * vocab_size * len(prompt_lens)
    return float(linear_flops + attention_flops + lm_head_flops)


# ---------------------------------------------------------------------------- per-system numbers


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
