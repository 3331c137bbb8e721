"""Workload E1: sentence embeddings, vacpack against sentence-transformers, side by side, one run.

E1 embeds 5,000 texts (20,000 on a GPU) with the real all-MiniLM-L6-v2 weights: a mix of short
queries (3..12 words) and passages (30..220 words), 6..243 tokens, 420,527 in all at the
default size (under the model's 256-token limit, so nothing is cut), made of English words drawn
from the model's own vocabulary with Zipf-like weights (seed 0), so texts vary as real ones do.
Four systems, each in its own subprocess (`--worker SYSTEM`), after an untimed warm-up (where
vacpack measures its bin budget):

- vacpack_bf16 / vacpack_fp32: `LLM(model, dtype=...).embed(texts)`, padding-free packed bins.
- st_bf16 / st_fp32: `SentenceTransformer(model).encode(texts, batch_size=32)`, which sorts
  texts by length and pads each batch to its longest; st_bf16 is the model cast to bfloat16.
- vllm_bf16 / vllm_fp32: vLLM's CPU build, `LLM(model, runner="pooling").embed(texts)`, in its
  own environment (installed by `make bench`; on a CPU only: bench/e1_vllm.py).

Every worker saves its embeddings for the agreement check: the cosine between vacpack's and
sentence-transformers' embedding of each text. Three more workers say where the time goes
(`--no-analysis` skips them), in bf16 where a bf16 system ran, else in float32: the matmul peak
at the encoder's shapes, against which each system's model FLOPs utilisation (MFU) in that
dtype is computed, and a torch.profiler run of vacpack and sentence-transformers over the first
1,000 texts, whose self CPU time is split by kind of op (matmul, attention, GELU, LayerNorm,
other). Writes JSON and a bar chart, and prints a markdown table.

Full run (10 to 15 minutes on a 2-core CPU, estimated from small runs; 20,000 texts on a GPU):
    python bench/e1_embeddings.py
`--max-num-batched-tokens N` gives vacpack a fixed bin budget instead of its measured one
(the probe can pick small bins on a machine busy with other work).
Quick check that everything works:
    python bench/e1_embeddings.py --num-texts 50 \
        --output bench/results/tmp/e1_small.json --plot bench/results/tmp/e1_small.png
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import vllm_cpu
import workers
from e1_analysis import run_matmul_peak, run_profile, time_analysis
from e1_report import cosine_agreement, markdown_table, save_plot, speedup_ratios, target_checks
from e1_vllm import VLLM_SYSTEMS, run_vllm
from e1_workload import (
    DEFAULT_NUM_TEXTS,
    DTYPE_NAMES,
    DTYPES,
    MATMUL_PEAK_WORKERS,
    PASSAGE_WORDS,
    PROFILE_WORKERS,
    QUERY_SHARE,
    QUERY_WORDS,
    RESULTS_DIR,
    SYSTEMS,
    TEXT_SEED,
    WARMUP_TEXTS,
    analysis_dtype,
    analysis_workers,
    default_model_dir,
    log,
    make_texts,
    word_list,
)
from harness import (
    heartbeat,
    job_report_fields,
    machine_description,
    peak_memory_bytes,
    resolve_device,
)
from process_timing import timed_section
from workers import (
    run_catching_errors,
    save_worker_result,
)

# ---------------------------------------------------------------------------- workers


def run_vacpack(args: argparse.Namespace, texts: list[str], dtype_name: str) -> dict[str, Any]:
    from vacpack import LLM
    from vacpack.outputs import embeddings_array

    name = f"vacpack_{dtype_name}"
    log(f"{name}: loading the model (not timed)")
    # max_num_batched_tokens=None: the bin budget is measured by probe forwards on first use.
    llm = LLM(
        str(args.model_dir),
        dtype=DTYPE_NAMES[dtype_name],
        device=args.device,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    log(f"{name}: warm-up job, which also measures the bin budget (not timed)")
    llm.embed(texts[:WARMUP_TEXTS], use_tqdm=False)
    runner = llm.corpus_runner

    def status() -> str:
        report = runner.last_report
        return f"{report.num_documents} texts done" if report else "starting"

    log(f"{name}: embedding {len(texts)} texts")
    with heartbeat(name, status), timed_section() as section:
        outputs = llm.embed(texts, use_tqdm=False)
    report = runner.last_report
    assert report is not None  # set by the job that just ran
    np.save(args.embeddings_output, embeddings_array(outputs))
    return {
        **section.fields(),
        "num_real_tokens": report.num_real_tokens,
        "texts_per_s": len(texts) / section.wall_s,
        "tokens_per_s": report.num_real_tokens / section.wall_s,
        "padding_fraction": report.padding_overhead,
        "peak_memory_bytes": peak_memory_bytes(args.device),
        # "bfloat16 weights, float32 arithmetic" where this CPU measured that faster.
        "dtype": llm.loaded.dtype_description,
        "job_report": job_report_fields(report),
    }


def st_batch_tokens(model: Any, texts: list[str], batch_size: int) -> tuple[int, int]:
    """(real tokens, tokens run through the model) of `encode`'s batches, replayed after the
    timed call: the same length sort, batches and tokenization (truncated at max_seq_length)."""
    flattened = getattr(model, "_can_flatten_inputs", lambda: False)()
    order = np.argsort([-model._input_length(text) for text in texts])
    num_real, num_processed = 0, 0
    for start in range(0, len(texts), batch_size):
        batch = [texts[i] for i in order[start : start + batch_size]]
        attention_mask = model.preprocess(batch)["attention_mask"]
        num_real += int(attention_mask.sum())
        # Flattened batches (flash-attention varlen, on some GPUs) carry no padding.
        num_processed += int(attention_mask.sum()) if flattened else attention_mask.numel()
    return num_real, num_processed


def run_st(args: argparse.Namespace, texts: list[str], dtype_name: str) -> dict[str, Any]:
    from sentence_transformers import SentenceTransformer

    name = f"st_{dtype_name}"
    log(f"{name}: loading the model (not timed)")
    model = SentenceTransformer(str(args.model_dir), device=args.device)
    model.to(DTYPES[dtype_name])
    log(f"{name}: warm-up batch (not timed)")
    model.encode(texts[:WARMUP_TEXTS], batch_size=args.st_batch_size, show_progress_bar=False)
    log(f"{name}: embedding {len(texts)} texts")
    with heartbeat(name, lambda: "running"), timed_section() as section:
        embeddings = model.encode(texts, batch_size=args.st_batch_size, show_progress_bar=False)
    np.save(args.embeddings_output, np.asarray(embeddings, dtype=np.float32))
    num_real, num_processed = st_batch_tokens(model, texts, args.st_batch_size)
    return {
        **section.fields(),
        "num_real_tokens": num_real,
        "texts_per_s": len(texts) / section.wall_s,
        "tokens_per_s": num_real / section.wall_s,
        "padding_fraction": (num_processed - num_real) / num_processed,
        "peak_memory_bytes": peak_memory_bytes(args.device),
        "batch_size": args.st_batch_size,
        "max_seq_length": model.max_seq_length,
        "dtype": str(next(model.parameters()).dtype),
    }


WORKERS: dict[str, Callable[[argparse.Namespace, list[str]], dict[str, Any]]] = {
    **{
        worker: lambda args, texts, dtype_name=dtype_name: run_matmul_peak(args, texts, dtype_name)
        for worker, dtype_name in MATMUL_PEAK_WORKERS.items()
    },
    **{
        worker: lambda args, texts, system=system: run_profile(args, texts, system)
        for worker, system in PROFILE_WORKERS.items()
    },
    "vacpack_bf16": lambda args, texts: run_vacpack(args, texts, "bf16"),
    "vacpack_fp32": lambda args, texts: run_vacpack(args, texts, "fp32"),
    "st_bf16": lambda args, texts: run_st(args, texts, "bf16"),
    "st_fp32": lambda args, texts: run_st(args, texts, "fp32"),
}


def worker_main(args: argparse.Namespace) -> int:
    texts = make_texts(args.num_texts, word_list(args.model_dir))
    result = run_catching_errors(lambda: WORKERS[args.worker](args, texts))
    save_worker_result(result, Path(args.worker_output))
    return 0


# ---------------------------------------------------------------------------- orchestration


# The options a worker gets from the orchestrating run.
WORKER_OPTIONS: tuple[str, ...] = (
    "device",
    "num_texts",
    "st_batch_size",
    "model_dir",
    "max_num_batched_tokens",
)


def worker_command(
    args: argparse.Namespace, worker: str, worker_output: Path, embeddings_output: Path
) -> list[str]:
    command = workers.worker_command(__file__, worker, worker_output, args, WORKER_OPTIONS)
    return [*command, "--embeddings-output", str(embeddings_output)]


def orchestrate(args: argparse.Namespace) -> int:
    systems_to_run = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(systems_to_run) - set(SYSTEMS))
    if unknown:
        raise SystemExit(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
    texts = make_texts(args.num_texts, word_list(args.model_dir))
    word_counts = [len(t.split()) for t in texts]
    log(f"{len(texts)} texts, {sum(word_counts):,} words, on {args.device}")

    dtype_name = analysis_dtype(systems_to_run)
    systems: dict[str, dict[str, Any]] = {}
    embeddings: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory(prefix="e1-embeddings-") as tmp_dir:
        for index, name in enumerate(systems_to_run):
            log(f"system {index + 1}/{len(systems_to_run)}: {name}")
            embeddings_path = Path(tmp_dir) / f"{name}.npy"
            if name in VLLM_SYSTEMS:  # runs in vLLM's own environment
                warmup_texts = texts[:WARMUP_TEXTS]
                systems[name] = run_vllm(args, texts, warmup_texts, name, embeddings_path)
            else:
                systems[name] = workers.run_worker(
                    lambda path, name=name, out=embeddings_path: worker_command(
                        args, name, path, out
                    ),
                    name,
                    "e1",
                )
            if embeddings_path.exists():
                embeddings[name] = np.load(embeddings_path)
        analysis = {
            worker: workers.run_worker(
                lambda path, worker=worker, out=Path(tmp_dir) / "unused.npy": worker_command(
                    args, worker, path, out
                ),
                worker,
                "e1",
            )
            for worker in (analysis_workers(dtype_name) if args.analysis else ())
        }
    token_counts = {s["num_real_tokens"] for s in systems.values() if "num_real_tokens" in s}
    ratios = speedup_ratios(systems)
    agreement = cosine_agreement(embeddings)
    results: dict[str, Any] = {
        "workload": {
            "name": "E1",
            "model": "all-MiniLM-L6-v2 (real weights)",
            "model_dir": str(args.model_dir),
            "device": args.device,
            "num_texts": args.num_texts,
            "text_seed": TEXT_SEED,
            "query_share": QUERY_SHARE,
            "query_words": list(QUERY_WORDS),
            "passage_words": list(PASSAGE_WORDS),
            "num_words": sum(word_counts),
            "st_batch_size": args.st_batch_size,
            "vacpack_bin_budget_tokens": args.max_num_batched_tokens or "measured on first use",
            "warmup": f"an untimed job of {WARMUP_TEXTS} texts before the timed one, in every "
            "worker; vacpack measures its bin budget there",
            # Every system should run the same tokens (truncated at 256): a check on the inputs.
            "systems_count_the_same_tokens": len(token_counts) <= 1,
        },
        "machine": machine_description(),
        "systems": systems,
        "ratios": ratios,
        "targets": target_checks(ratios, agreement),
        "cosine_agreement": agreement,
        "where_the_time_goes": time_analysis(args, texts, systems, analysis, dtype_name),
        "notes": {
            "peak_memory": "the worker process's ru_maxrss on CPU, "
            "torch.cuda.max_memory_allocated on CUDA",
            "padding": "vacpack's from its job report; sentence-transformers' from replaying "
            "encode's length-sorted batches of its tokenizer's lengths",
        },
    }

    workers.publish_results(
        results, args.output, args.plot, save_plot, markdown_table(results), "e1"
    )
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--systems",
        default=None,
        help=f"comma-separated subset of {', '.join(SYSTEMS)} (vllm_*: on a CPU only)",
    )
    parser.add_argument("--device", default="auto", help="cpu, cuda, or auto (cuda if present)")
    parser.add_argument(
        "--num-texts", type=int, default=None, help="default 5,000 on CPU, 20,000 on a GPU"
    )
    parser.add_argument("--st-batch-size", type=int, default=32)
    parser.add_argument("--model-dir", type=Path, default=None, help="default all-MiniLM-L6-v2")
    parser.add_argument("--output", type=Path, default=None, help="default results/e1_DEVICE.json")
    parser.add_argument("--plot", type=Path, default=None, help="default: --output as .png")
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="vacpack's bin budget in tokens; default measured by its probe forwards",
    )
    parser.add_argument(
        "--no-analysis",
        dest="analysis",
        action="store_false",
        help="skip the matmul-peak and profile workers (MFU and where the time goes)",
    )
    parser.add_argument(
        "--vllm-kv-cache-gib",
        type=float,
        default=vllm_cpu.DEFAULT_KV_CACHE_GIB,
        help="vllm_*'s KV cache size (an embedding model uses none, but vLLM sizes one)",
    )
    # Internal: run one system in this process, write its result and its embeddings.
    parser.add_argument("--worker", choices=[*WORKERS], help=argparse.SUPPRESS)
    parser.add_argument("--worker-output", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--embeddings-output", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.device = resolve_device(args.device)
    device_type = args.device.split(":")[0]
    if args.num_texts is None:
        args.num_texts = DEFAULT_NUM_TEXTS.get(device_type, DEFAULT_NUM_TEXTS["cpu"])
    if args.systems is None:
        on_cpu = device_type == "cpu"
        args.systems = ",".join(s for s in SYSTEMS if on_cpu or s not in VLLM_SYSTEMS)
    if args.num_texts < 1:
        parser.error("--num-texts must be at least 1")
    args.model_dir = args.model_dir or default_model_dir()
    args.output = args.output or RESULTS_DIR / f"e1_{device_type}.json"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return worker_main(args)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
