"""ProcessorConfig and build_processor: a vacpack task over a Ray Dataset, as Ray Data's LLM
processors do it (a config, then `processor(dataset) -> dataset`).

    config = ProcessorConfig(model="my-encoder", task="embed", concurrency=4, num_cpus=8)
    start_s = time.perf_counter()
    with build_processor(config) as processor:
        processor(ray.data.read_parquet("s3://bucket/corpus/")).write_parquet("s3://bucket/out/")
        print(processor.figures(time.perf_counter() - start_s).summary())

Ray runs the actor pool: it places the replicas on the cluster's nodes, feeds them batches,
restarts a replica that dies and runs its unfinished batch again. Rows come out in input order
when the DataContext asks for it (`execution_options.preserve_order = True`). Leave the
cluster a CPU that no replica reserves: Ray Data hangs when its reading and writing tasks find
none (ray-project/ray#44687).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import ray

from vacpack.ray.actors import ACTORS
from vacpack.ray.figures import FiguresCollectorActor, JobFigures, job_figures

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProcessorConfig:
    model: str  # a local checkpoint directory (on every node) or a hub id
    task: str  # embed, classify, loglikelihood or generate
    engine_kwargs: Mapping[str, Any] = field(default_factory=dict)  # LLM's engine arguments
    # The task's own options: embed (pooling, normalize, truncate), classify (truncate),
    # loglikelihood (return_token_logprobs, truncate), generate (sampling_params).
    task_kwargs: Mapping[str, Any] = field(default_factory=dict)
    input_column: str | None = None  # default: text, input or prompt (generate: or messages)
    concurrency: int = 1  # replicas: actors, each with its own model
    batch_size: int = 1024  # rows per call; vacpack packs each batch into token-budget bins
    num_cpus: float = 1.0  # per replica
    num_gpus: float = 0.0  # per replica

    def __post_init__(self) -> None:
        if self.task not in ACTORS:
            raise ValueError(f"task must be one of {sorted(ACTORS)}, got {self.task!r}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.num_cpus < 0 or self.num_gpus < 0:
            raise ValueError(
                f"num_cpus and num_gpus must be >= 0, got {self.num_cpus} and {self.num_gpus}"
            )


class Processor:
    """Applies a ProcessorConfig to datasets; collects what every replica reports.

    Needs a running Ray (`ray.init`). `close()` (or leaving a `with` block) ends the figures'
    collector actor.
    """

    def __init__(self, config: ProcessorConfig) -> None:
        self.config = config
        # An actor handle: Ray types its methods' `.remote` only in part.
        self._collector: Any = FiguresCollectorActor.remote()

    def __call__(self, dataset: ray.data.Dataset) -> ray.data.Dataset:
        config = self.config
        cluster_cpus = ray.cluster_resources().get("CPU", 0.0)
        if not leaves_a_cpu_free(config.concurrency, config.num_cpus, cluster_cpus):
            logger.warning(
                "%s (unless the cluster is about to grow)",
                cpu_shortage_message(config.concurrency, config.num_cpus, cluster_cpus),
            )
        return dataset.map_batches(
            ACTORS[config.task],
            fn_constructor_kwargs={
                "model": config.model,
                "engine_kwargs": dict(config.engine_kwargs),
                "input_column": config.input_column,
                "figures_collector": self._collector,
                **config.task_kwargs,
            },
            compute=ray.data.ActorPoolStrategy(size=config.concurrency),
            batch_format="pyarrow",
            batch_size=config.batch_size,
            num_cpus=config.num_cpus,
            num_gpus=config.num_gpus,
            # One row out per row in.
            udf_modifying_row_count=False,
        )

    def figures(self, wall_s: float) -> JobFigures:
        """Every replica's figures so far, and their sum over `wall_s` (the driver's time)."""
        return job_figures(ray.get(self._collector.all.remote()), wall_s)

    def close(self) -> None:
        ray.kill(self._collector)

    def __enter__(self) -> Processor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def build_processor(config: ProcessorConfig) -> Processor:
    return Processor(config)


def leaves_a_cpu_free(num_replicas: int, cpus_per_replica: float, cluster_cpus: float) -> bool:
    return num_replicas * cpus_per_replica <= cluster_cpus - 1


def cpu_shortage_message(num_replicas: int, cpus_per_replica: float, cluster_cpus: float) -> str:
    return (
        f"{num_replicas} replicas of {cpus_per_replica:g} CPUs leave no CPU of the cluster's "
        f"{cluster_cpus:g} free for Ray Data's reading and writing tasks, which would wait for "
        "one forever: give the replicas fewer CPUs, or the cluster more"
    )
