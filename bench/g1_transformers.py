"""G1's baselines: transformers `generate` on left-padded batches and `generate_batch`, its
continuous batching, each run in a worker process of bench/g1_generation.py."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import inspect
import math
import time
from typing import Any

import torch
from g1_workload import (
    HF_CB_PAGE_SIZE_TOKENS,
    HF_CB_RESOLVED_FIELDS,
    PAD_TOKEN_ID,
    WARMUP_NUM_PROMPTS,
    WARMUP_OUTPUT_TOKENS,
    is_cuda,
    log,
    make_warmup_prompts,
    step_budget_tokens,
    throughput_fields,
)
from harness import heartbeat
from process_timing import timed_section


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
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=getattr(torch, args.dtype))
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


# Fields that older transformers releases call by another name: the page size in tokens is
# `block_size` in 5.17 (seen on a GPU machine's image), `page_size` in later releases.
_OLDER_FIELD_NAMES = {"page_size": "block_size"}


def hf_cb_config(fields: dict[str, Any]) -> Any:
    """A ContinuousBatchingConfig, refusing a field this transformers version does not have
    (silently dropping it would measure something other than what the results say)."""
    import transformers
    from transformers import ContinuousBatchingConfig

    known = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    fields = {
        name if name in known else _OLDER_FIELD_NAMES.get(name, name): value
        for name, value in fields.items()
    }
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
        args.model_dir, dtype=getattr(torch, args.dtype), attn_implementation="sdpa"
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
