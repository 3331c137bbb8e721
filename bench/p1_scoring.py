"""Workload P1: scoring a skewed corpus, vacpack's packed bins against padded transformers batches.

P1 is a random-weight model with the exact shapes of Qwen2.5-0.5B in bfloat16 (`--dtype float32`
for CPUs whose bf16 matmuls are slow; G1's checkpoint), scoring the log-likelihood of every
token of 128 random-token documents (400 on a GPU): short ones (45..130 tokens) alternating with
long ones (1800..2000 tokens), then shuffled (seed 0), so that almost every batch of 8 in input
order holds a long document and pads to it. Every document is scored after one prefix token (the
tokenizer's BOS, else its EOS), as `LLM.loglikelihood` does, so all systems compute the same
numbers:

- vacpack: `LLM.loglikelihood` over token-id lists (padding-free packed bins).
- hf_padded: transformers `AutoModelForCausalLM` forwards over right-padded batches of 8 in
  input order, log_softmax over the logits, the next tokens gathered, padding left out.
- hf_sorted: the same over batches of 8 sorted by length (the usual fix for padding).
- vllm_cpu: vLLM's CPU build (installed by `make bench` into its own environment) with
  `prompt_logprobs=0`, the same prefix token in front, on a CPU only (bench/p1_vllm.py).

Each system runs in its own subprocess (`--worker SYSTEM`) after an untimed warm-up (for vacpack
this is where it measures its bin budget). Tokens/s counts real tokens (prefix included), never
padding. Writes JSON and a bar chart, and prints a markdown table.

Full run (about 25 minutes on a 2-core CPU, estimated from G1's rates; 400 documents on a GPU):
    python bench/p1_scoring.py
`--max-num-batched-tokens N` gives vacpack a fixed bin budget instead of its measured one
(the probe can pick small bins on a machine busy with other work).
Quick check that everything works:
    python bench/p1_scoring.py --num-docs 6 --long-min 300 --long-max 400 \
        --output bench/results/tmp/p1_small.json --plot bench/results/tmp/p1_small.png
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import checkpoints
import p1_vllm
import torch
import vllm_cpu
import workers
from harness import (
    heartbeat,
    job_report_fields,
    machine_description,
    peak_memory_bytes,
    resolve_device,
)
from p1_report import (
    logprob_agreement,
    markdown_table,
    ratios_over_baselines,
    save_plot,
    target_checks,
)
from p1_workload import (
    CORPUS_SEED,
    DEFAULT_NUM_DOCS,
    PAD_TOKEN_ID,
    RESULTS_DIR,
    SYSTEMS,
    VLLM_SYSTEMS,
    WARMUP_DOCS,
    WARMUP_TOKENS,
    corpus_for,
    log,
    prefix_token_id,
)
from process_timing import timed_section
from workers import (
    run_catching_errors,
    save_worker_result,
)

# ---------------------------------------------------------------------------- workers


def run_vacpack(args: argparse.Namespace, documents: list[list[int]]) -> dict[str, Any]:
    from vacpack import LLM
    from vacpack.corpus.tasks import LoglikelihoodTask

    log("vacpack: loading the model (not timed)")
    # max_num_batched_tokens=None: the bin budget is measured by probe forwards on first use.
    llm = LLM(
        str(args.model_dir),
        dtype=args.dtype,
        device=args.device,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    log("vacpack: warm-up job, which also measures the bin budget (not timed)")
    llm.loglikelihood([doc[:WARMUP_TOKENS] for doc in documents[:WARMUP_DOCS]], use_tqdm=False)
    runner = llm.corpus_runner

    def status() -> str:
        report = runner.last_report
        return f"{report.num_documents} documents done" if report else "starting"

    log(f"vacpack: scoring {len(documents)} documents")
    with heartbeat("vacpack", status), timed_section() as section:
        outputs = llm.loglikelihood(documents, use_tqdm=False)
    report = runner.last_report
    assert report is not None  # set by the job that just ran
    scored_counts_ok = all(
        out.num_tokens == len(doc) for out, doc in zip(outputs, documents, strict=True)
    )
    return {
        **section.fields(),
        "num_real_tokens": report.num_real_tokens,
        "num_padding_tokens": report.num_padding_tokens,
        "tokens_per_s": report.num_real_tokens / section.wall_s,
        "documents_per_s": len(documents) / section.wall_s,
        "padding_fraction": report.padding_overhead,
        "peak_memory_bytes": peak_memory_bytes(args.device),
        "prefix_token_id": LoglikelihoodTask(llm.loaded).prefix_token_id,
        "every_token_scored": scored_counts_ok,
        # The job report's own numbers (timed from the start of the job, budget already known).
        "job_report": job_report_fields(report),
        # Kept for the agreement check; not copied into the results file.
        "document_logprobs": [out.logprob for out in outputs],
    }


@torch.inference_mode()
def padded_batch_logprobs(
    model: torch.nn.Module, sequences: list[list[int]], device: str
) -> tuple[list[float], int]:
    """Total log-probability of each sequence's tokens after its first, and the tokens run
    through the model (padding included), from one right-padded forward."""
    max_len = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), max_len), PAD_TOKEN_ID, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), max_len), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        input_ids[row, : len(sequence)] = torch.tensor(sequence)
        attention_mask[row, : len(sequence)] = 1
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    # No KV cache: scoring never decodes, so building one would only cost memory.
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    totals = []
    for row, sequence in enumerate(sequences):
        # One document at a time, real rows only (that is the padding mask): float32 log-probs of
        # the whole batch at once would be [8, 2001, 151936] floats, 9.7 GB.
        row_logprobs = torch.log_softmax(logits[row, : len(sequence) - 1].float(), dim=-1)
        targets = input_ids[row, 1 : len(sequence)].unsqueeze(1)
        totals.append(float(row_logprobs.gather(1, targets).double().sum()))
    return totals, input_ids.numel()


def run_hf(
    args: argparse.Namespace, documents: list[list[int]], sort_by_length: bool
) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    name = "hf_sorted" if sort_by_length else "hf_padded"
    log(f"{name}: loading the model (not timed)")
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=getattr(torch, args.dtype))
    model = model.to(args.device).eval()
    prefix = prefix_token_id(args.model_dir)
    sequences = [[prefix, *doc] for doc in documents]
    order = list(range(len(sequences)))
    if sort_by_length:
        order.sort(key=lambda i: len(sequences[i]))
    batches = [order[i : i + args.hf_batch_size] for i in range(0, len(order), args.hf_batch_size)]

    log(f"{name}: warm-up batch (not timed)")
    padded_batch_logprobs(model, [s[:WARMUP_TOKENS] for s in sequences[:WARMUP_DOCS]], args.device)
    logprobs: list[float] = [0.0] * len(sequences)
    num_processed_tokens = 0
    num_batches_done = 0
    log(f"{name}: scoring {len(documents)} documents in {len(batches)} batches")

    def status() -> str:
        return f"{num_batches_done}/{len(batches)} batches done"

    with heartbeat(name, status), timed_section() as section:
        for batch in batches:
            totals, num_batch_tokens = padded_batch_logprobs(
                model, [sequences[i] for i in batch], args.device
            )
            for index, total in zip(batch, totals, strict=True):
                logprobs[index] = total
            num_processed_tokens += num_batch_tokens
            num_batches_done += 1
    num_real_tokens = sum(len(s) for s in sequences)
    return {
        **section.fields(),
        "num_real_tokens": num_real_tokens,
        "num_padding_tokens": num_processed_tokens - num_real_tokens,
        "tokens_per_s": num_real_tokens / section.wall_s,
        "documents_per_s": len(documents) / section.wall_s,
        "padding_fraction": (num_processed_tokens - num_real_tokens) / num_processed_tokens,
        "peak_memory_bytes": peak_memory_bytes(args.device),
        "prefix_token_id": prefix,
        "batch_size": args.hf_batch_size,
        "batch_order": "sorted by length" if sort_by_length else "input order",
        "attn_implementation": model.config._attn_implementation,
        "document_logprobs": logprobs,
    }


WORKERS: dict[str, Callable[[argparse.Namespace, list[list[int]]], dict[str, Any]]] = {
    "vacpack": run_vacpack,
    "hf_padded": lambda args, docs: run_hf(args, docs, sort_by_length=False),
    "hf_sorted": lambda args, docs: run_hf(args, docs, sort_by_length=True),
}


def worker_main(args: argparse.Namespace) -> int:
    documents = corpus_for(args)
    result = run_catching_errors(lambda: WORKERS[args.worker](args, documents))
    save_worker_result(result, Path(args.worker_output))
    return 0


# ---------------------------------------------------------------------------- orchestration


# The options a worker gets from the orchestrating run.
WORKER_OPTIONS: tuple[str, ...] = (
    "device", "num_docs", "short_min", "short_max", "long_min", "long_max", "hf_batch_size",
    "model_dir", "max_num_batched_tokens", "dtype",
)  # fmt: skip


def worker_command(args: argparse.Namespace, worker: str, worker_output: Path) -> list[str]:
    return workers.worker_command(__file__, worker, worker_output, args, WORKER_OPTIONS)


def run_vllm_cpu(args: argparse.Namespace, documents: list[list[int]]) -> dict[str, Any]:
    prefix = prefix_token_id(args.model_dir)
    sequences = [[prefix, *doc] for doc in documents]
    warmup_sequences = [s[:WARMUP_TOKENS] for s in sequences[:WARMUP_DOCS]]
    return p1_vllm.run_vllm_cpu(args, sequences, warmup_sequences)


def orchestrate(args: argparse.Namespace) -> int:
    systems_to_run = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(systems_to_run) - set(SYSTEMS))
    if unknown:
        raise SystemExit(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
    model_dir = checkpoints.ensure_qwen2_5_0_5b_shapes_checkpoint(args.model_dir, "p1")
    documents = corpus_for(args)
    doc_lens = [len(d) for d in documents]
    log(f"{len(documents)} documents, {sum(doc_lens):,} tokens, on {args.device}")

    systems: dict[str, dict[str, Any]] = {}
    for index, name in enumerate(systems_to_run):
        log(f"system {index + 1}/{len(systems_to_run)}: {name}")
        if name in VLLM_SYSTEMS:
            systems[name] = run_vllm_cpu(args, documents)
            continue
        systems[name] = workers.run_worker(
            lambda path, name=name: worker_command(args, name, path), name, "p1"
        )
    prefixes = {s["prefix_token_id"] for s in systems.values() if "prefix_token_id" in s}
    ratios = ratios_over_baselines(systems)
    results: dict[str, Any] = {
        "workload": {
            "name": "P1",
            "model": f"random weights, Qwen2.5-0.5B shapes, {args.dtype}",
            "model_dir": str(model_dir),
            "device": args.device,
            "num_docs": args.num_docs,
            "short_range_tokens": [args.short_min, args.short_max],
            "long_range_tokens": [args.long_min, args.long_max],
            "corpus_seed": CORPUS_SEED,
            "num_document_tokens": sum(doc_lens),
            # Every document is scored after one prefix token, which the model also runs.
            "num_real_tokens": sum(doc_lens) + len(doc_lens),
            "hf_batch_size": args.hf_batch_size,
            "vacpack_bin_budget_tokens": args.max_num_batched_tokens or "measured on first use",
            "warmup": f"an untimed job of {WARMUP_DOCS} documents cut to {WARMUP_TOKENS} tokens "
            "before the timed one, in every worker; vacpack measures its bin budget there",
            "prefix_token_ids_agree": len(prefixes) <= 1,
        },
        "machine": machine_description(),
        "systems": systems,
        "ratios": ratios,
        "targets": target_checks(systems, ratios),
        "logprob_agreement": logprob_agreement(systems),
        "notes": {
            "peak_memory": "peak memory is the worker process's ru_maxrss on CPU (model, "
            "activations and, for transformers, the full logits tensor) and "
            "torch.cuda.max_memory_allocated on CUDA; vacpack's corpus runner allocates no "
            "generation KV cache",
            "tokens_per_s": "real tokens (prefix token included, padding excluded) over the "
            "wall time of the timed call",
        },
    }
    if len(prefixes) > 1:
        log(f"WARNING: the systems scored after different prefix tokens: {sorted(prefixes)}")
    for system in systems.values():
        system.pop("document_logprobs", None)

    workers.publish_results(
        results, args.output, args.plot, save_plot, markdown_table(results), "p1"
    )
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--systems",
        default=None,
        help=f"comma-separated subset of {', '.join(SYSTEMS)} (vllm_cpu: on a CPU only)",
    )
    parser.add_argument("--device", default="auto", help="cpu, cuda, or auto (cuda if present)")
    parser.add_argument(
        "--num-docs", type=int, default=None, help="default 128 on CPU, 400 on a GPU"
    )
    parser.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        default="bfloat16",
        help="every system's dtype (float32 where this CPU's bf16 matmuls are slow)",
    )
    parser.add_argument("--short-min", type=int, default=45, help="short documents' min tokens")
    parser.add_argument("--short-max", type=int, default=130)
    parser.add_argument("--long-min", type=int, default=1800, help="long documents' min tokens")
    parser.add_argument("--long-max", type=int, default=2000)
    parser.add_argument("--hf-batch-size", type=int, default=8)
    parser.add_argument("--model-dir", type=Path, default=checkpoints.QWEN2_5_0_5B_SHAPES_DIR)
    parser.add_argument("--output", type=Path, default=None, help="default results/p1_DEVICE.json")
    parser.add_argument("--plot", type=Path, default=None, help="default: --output as .png")
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="vacpack's bin budget in tokens; default measured by its probe forwards",
    )
    parser.add_argument(
        "--vllm-kv-cache-gib",
        type=float,
        default=vllm_cpu.DEFAULT_KV_CACHE_GIB,
        help="vllm_cpu's KV cache size",
    )
    # Internal: run one system in this process and write its result to --worker-output.
    parser.add_argument("--worker", choices=[*WORKERS], help=argparse.SUPPRESS)
    parser.add_argument("--worker-output", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not 1 <= args.short_min <= args.short_max or not 1 <= args.long_min <= args.long_max:
        parser.error("need 1 <= --short-min <= --short-max and 1 <= --long-min <= --long-max")
    args.device = resolve_device(args.device)
    device_type = args.device.split(":")[0]
    if args.num_docs is None:
        args.num_docs = DEFAULT_NUM_DOCS.get(device_type, DEFAULT_NUM_DOCS["cpu"])
    if args.systems is None:
        on_cpu = device_type == "cpu"
        args.systems = ",".join(s for s in SYSTEMS if on_cpu or s not in VLLM_SYSTEMS)
    if args.num_docs < 1:
        parser.error("--num-docs must be at least 1")
    args.output = args.output or RESULTS_DIR / f"p1_{device_type}.json"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return worker_main(args)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
