"""A corpus job on Ray: 1 replica against 2 on the same machine, and the single process beside.

E1's workload (queries and passages of seeded random words, `bench/e1_embeddings.py`) embedded
with the real all-MiniLM-L6-v2 weights, or scored with `--task loglikelihood` on a model given
by `--model-dir`. The texts go through a Parquet file, so that Ray Data reads them as the
`--ray` command line does. Three systems, in this order:

- single: `LLM(model).embed(texts)` in this process, all cores, no Ray; the model's loading
  and a warm-up of a few texts are not timed.
- ray_1: one replica holding every core (`num_cpus` = the machine's).
- ray_2: two replicas with half the cores each.

Both Ray runs share one local Ray instance started before them (its start-up is not timed);
each job's wall time includes its replicas' model loading, as a user's job does, and each
replica reports its own figures (tokens/s over its span, device busy, model load), whose rates
are summed into the steady-state rate. On one machine the replicas share its cores, so two
replicas can only gain what one process loses to thread synchronisation and to the gaps where
its device waits for Ray to hand it a batch; on a cluster each replica brings its own node.

Full run (a few minutes on a 2-core CPU):
    python bench/ray_corpus.py
Quick check that everything works:
    python bench/ray_corpus.py --num-texts 200 --output bench/results/tmp/ray_small.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import harness
from e1_workload import default_model_dir, make_texts, word_list
from harness import machine_description
from process_timing import machine_busy_cpu_s

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUTPUT = REPO_ROOT / "bench" / "results" / "ray_corpus_cpu.json"
DEFAULT_NUM_TEXTS = 5000
# Rows per replica call: large enough for first-fit decreasing to pack full bins, small
# enough that both replicas get several batches of the default workload.
DEFAULT_BATCH_SIZE = 512
OBJECT_STORE_BYTES = 512 * 2**20
WARMUP_TEXTS = 8


def log(message: str) -> None:
    harness.log(message, "ray")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=["embed", "loglikelihood"], default="embed")
    parser.add_argument("--model-dir", type=Path, default=None, help="default: all-MiniLM-L6-v2")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-texts", type=int, default=DEFAULT_NUM_TEXTS)
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--cpus", type=int, default=os.cpu_count() or 1, help="for Ray")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    return parser.parse_args()


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {"dtype": args.dtype, "max_num_batched_tokens": args.max_num_batched_tokens}


def run_single(args: argparse.Namespace, texts: list[str]) -> dict[str, Any]:
    from vacpack import LLM

    llm = LLM(str(args.model_dir), **engine_kwargs(args))
    run = llm.embed if args.task == "embed" else llm.loglikelihood
    # Untimed: the first forwards measure vacpack's kernel choices and cache them on disk,
    # where the Ray replicas, started later on this machine, find them.
    run(texts[:WARMUP_TEXTS], use_tqdm=False)
    busy_before_s, start_s = machine_busy_cpu_s(), time.perf_counter()
    run(texts, use_tqdm=False)
    wall_s = time.perf_counter() - start_s
    report = llm.corpus_runner.last_report
    return {
        "wall_s": wall_s,
        "machine_busy_cpu_s": machine_busy_cpu_s() - busy_before_s,
        "num_real_tokens": report.num_real_tokens,
        "tokens_per_s": report.num_real_tokens / wall_s,
        "job_tokens_per_s": report.tokens_per_s,  # the job alone, model load excluded
        "device_busy_fraction": report.device_busy_fraction,
        "padding_fraction": report.padding_overhead,
    }


def run_on_ray(args: argparse.Namespace, corpus: Path, num_replicas: int) -> dict[str, Any]:
    from vacpack.ray import ProcessorConfig, build_processor
    from vacpack.ray.files import read_dataset

    config = ProcessorConfig(
        model=str(args.model_dir),
        task=args.task,
        engine_kwargs=engine_kwargs(args),
        concurrency=num_replicas,
        batch_size=args.batch_size,
        # Each configuration uses the whole machine; Ray sets each replica's torch threads.
        num_cpus=args.cpus // num_replicas,
    )
    busy_before_s, start_s = machine_busy_cpu_s(), time.perf_counter()
    dataset = read_dataset(str(corpus), min_num_blocks=4 * num_replicas)
    with build_processor(config) as processor:
        num_rows = sum(
            batch.num_rows
            for batch in processor(dataset).iter_batches(batch_size=None, batch_format="pyarrow")
        )
        figures = processor.figures(time.perf_counter() - start_s)
    if num_rows != args.num_texts:
        raise RuntimeError(f"{num_rows} rows came back for {args.num_texts} texts")
    log(figures.summary())
    return {
        "wall_s": figures.wall_s,
        "machine_busy_cpu_s": machine_busy_cpu_s() - busy_before_s,
        "num_real_tokens": figures.num_real_tokens,
        "tokens_per_s": figures.tokens_per_s,
        "replicas_tokens_per_s": figures.replica_tokens_per_s,
        "device_busy_fraction": figures.device_busy_fraction,
        "padding_fraction": figures.padding_overhead,
        "replicas": [
            {**dataclasses.asdict(r), "tokens_per_s": r.tokens_per_s} for r in figures.replicas
        ],
    }


def main() -> int:
    args = parse_args()
    if args.model_dir is None:
        if args.task != "embed":
            raise SystemExit("--task loglikelihood needs --model-dir (a decoder)")
        args.model_dir = default_model_dir()
    texts = make_texts(args.num_texts, word_list(default_model_dir()))
    results: dict[str, Any] = {
        "task": args.task,
        "model": str(args.model_dir),
        "num_texts": args.num_texts,
        "batch_size": args.batch_size,
        "machine": machine_description(),
        "systems": {},
    }
    log(f"single process: {args.task} of {len(texts)} texts")
    results["systems"]["single"] = run_single(args, texts)

    import pyarrow as pa
    import pyarrow.parquet as pq
    import ray

    with tempfile.TemporaryDirectory() as scratch:
        corpus = Path(scratch) / "corpus.parquet"
        pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts}), corpus)
        ray.init(
            # One logical CPU more than the replicas take, for Ray Data's reading tasks: they
            # wait forever where replicas hold every CPU (ray-project/ray#44687).
            num_cpus=args.cpus + 1,
            object_store_memory=OBJECT_STORE_BYTES,
            include_dashboard=False,
            log_to_driver=False,
        )
        try:
            context = ray.data.DataContext.get_current()
            context.execution_options.preserve_order = True
            context.enable_progress_bars = False
            for num_replicas in (1, 2):
                log(f"Ray, {num_replicas} replica(s): {args.task} of {len(texts)} texts")
                results["systems"][f"ray_{num_replicas}"] = run_on_ray(args, corpus, num_replicas)
        finally:
            ray.shutdown()

    systems = results["systems"]
    results["ray_2_over_ray_1"] = systems["ray_1"]["wall_s"] / systems["ray_2"]["wall_s"]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    print("| system | wall s | tokens/s (wall) | replicas' tokens/s summed | device busy |")
    print("|---|---:|---:|---:|---:|")
    for name, system in systems.items():
        summed = system.get("replicas_tokens_per_s", system.get("job_tokens_per_s"))
        print(
            f"| {name} | {system['wall_s']:.2f} | {system['tokens_per_s']:,.0f} | "
            f"{summed:,.0f} | {system['device_busy_fraction']:.1%} |"
        )
    print(f"\n2 replicas against 1: {results['ray_2_over_ray_1']:.2f}x wall time", file=sys.stderr)
    log(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
