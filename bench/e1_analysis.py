"""E1's analysis of where the time goes: the encoder's FLOPs, the matmul peak at its shapes and
the torch.profiler split by kind of op, in the dtype of the systems run (each run in a worker
process of bench/e1_embeddings.py), and from them every system's model FLOPs utilisation."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import matmul_peak
import torch
from e1_workload import (
    DTYPE_NAMES,
    DTYPES,
    MATMUL_PEAK_ROWS,
    MATMUL_PEAK_WORKERS,
    OP_KINDS,
    PROFILE_TEXTS,
    PROFILE_WORKERS,
    TARGET_SPEEDUP_SAME_DTYPE,
    WARMUP_TEXTS,
    log,
    peak_dtypes,
)
from process_timing import timed_section


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


def run_matmul_peak(args: argparse.Namespace, texts: list[str], dtype_name: str) -> dict[str, Any]:
    """Best linear-layer throughput in one dtype at the encoder's own shapes."""
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
                    matmul_peak.best_linear_tflops(
                        num_rows,
                        in_features,
                        out_features,
                        generator,
                        args.device,
                        DTYPES[dtype_name],
                    )
                )
                log(f"matmul peak: {per_shape[-1]['shape']}: {per_shape[-1]['best_tflops']:.3f}")
    return {
        "dtype": dtype_name,
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


def time_analysis(
    args: argparse.Namespace,
    texts: list[str],
    systems: dict[str, dict[str, Any]],
    analysis: dict[str, dict[str, Any]],
    dtype_name: str,
) -> dict[str, Any]:
    """Model FLOPs utilisation of every system in `dtype_name` against the best matmul peak
    measured in the arithmetic such a model may run in (peak_dtypes), and the profiles' shares
    of time by kind of op: how far each system is from the peak, and why."""
    flops = encoder_flops(args.model_dir, workload_seq_lens(args.model_dir, texts))
    peaks = [
        analysis[worker]
        for worker, dtype in MATMUL_PEAK_WORKERS.items()
        if dtype in peak_dtypes(dtype_name) and "best_tflops" in analysis.get(worker, {})
    ]
    peak = max(peaks, key=lambda p: p["best_tflops"], default={})
    peak_tflops = peak.get("best_tflops")
    utilisation = {}
    for name, system in systems.items():
        if "wall_s" not in system or not name.endswith(f"_{dtype_name}"):
            continue
        tflops = flops["total"] / system["wall_s"] / 1e12
        utilisation[name] = {
            "useful_tflops": tflops,
            "mfu": tflops / peak_tflops if peak_tflops else None,
        }
    baseline = utilisation.get(f"st_{dtype_name}", {}).get("mfu")
    return {
        "dtype": dtype_name,
        "flops": flops,
        "flops_note": "what any system must compute: linear layers and attention over the "
        "texts' real tokens, no padding; MFU is that over the wall time, over the peak",
        "matmul_peak": peak,
        "utilisation": utilisation,
        # The MFU vacpack would need to run at TARGET_SPEEDUP_SAME_DTYPE x sentence-transformers.
        "mfu_needed_for_target": baseline * TARGET_SPEEDUP_SAME_DTYPE if baseline else None,
        "profiles": {name: analysis[name] for name in PROFILE_WORKERS if name in analysis},
    }
