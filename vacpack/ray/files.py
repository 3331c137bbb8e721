"""Corpus files in and results out through Ray Data: JSONL, Parquet or plain text, local paths
or any filesystem Ray Data reads (s3://, gs://, ...), read and written by the cluster's nodes.
"""

from __future__ import annotations

import os

import ray

JSON_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIX = ".parquet"
OUTPUT_FORMATS = ("jsonl", "parquet")
# Reading and writing take no CPU slot, so that they are not queued behind the one CPU the
# replicas leave free (Ray Data's file listing still takes it); what they do (parse,
# compress) is small beside the model's work on the same cores.
IO_TASK_CPUS = 0
# pandas writes Ray Data's JSON with 10 decimal places unless told: too few for a float32
# embedding component near zero.
JSON_DOUBLE_PRECISION = 15


def read_dataset(path: str, min_num_blocks: int) -> ray.data.Dataset:
    """A dataset of the input: JSON objects (.jsonl/.json), Parquet (.parquet, or a directory
    of them), else plain text, one row per line (empty lines kept, so that rows match lines).

    A small input is split into `min_num_blocks` blocks, so that every replica gets some; a
    large one comes in more, as Ray Data splits what outgrows its target block size.
    """
    stripped = path.rstrip("/")
    if stripped.endswith(JSON_SUFFIXES):
        return ray.data.read_json(path, num_cpus=IO_TASK_CPUS, override_num_blocks=min_num_blocks)
    if stripped.endswith(PARQUET_SUFFIX) or _is_parquet_directory(path):
        dataset = ray.data.read_parquet(
            path, num_cpus=IO_TASK_CPUS, override_num_blocks=min_num_blocks
        )
        if stripped.endswith(PARQUET_SUFFIX):
            # A file is read in whole row groups, and a small one often holds one: it would
            # come as one block, and one replica would run the whole job. Split in order.
            dataset = dataset.repartition(min_num_blocks)
        return dataset
    return ray.data.read_text(
        path,
        drop_empty_lines=False,
        num_cpus=IO_TASK_CPUS,
        override_num_blocks=min_num_blocks,
    )


def output_format(path: str, given: str | None) -> str:
    if given is not None:
        if given not in OUTPUT_FORMATS:
            raise ValueError(f"the output format must be one of {OUTPUT_FORMATS}, got {given!r}")
        return given
    return "parquet" if path.rstrip("/").endswith(PARQUET_SUFFIX) else "jsonl"


def write_dataset(dataset: ray.data.Dataset, path: str, file_format: str) -> None:
    """Writes a directory of files, one per written block; with order preserved, their names
    sort in input order."""
    if file_format == "parquet":
        dataset.write_parquet(path, ray_remote_args={"num_cpus": IO_TASK_CPUS})
    else:
        dataset.write_json(
            path,
            ray_remote_args={"num_cpus": IO_TASK_CPUS},
            double_precision=JSON_DOUBLE_PRECISION,
            force_ascii=False,
        )


def _is_parquet_directory(path: str) -> bool:
    return os.path.isdir(path) and any(name.endswith(PARQUET_SUFFIX) for name in os.listdir(path))
