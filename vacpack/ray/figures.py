"""What each replica of a Ray job reports (a corpus job's figures), and their sum.

Every replica keeps running totals over the batches it has answered and, after each batch, hands
the whole snapshot to a collector actor. The collector keeps the latest snapshot per replica, so
a message that arrives twice changes nothing, and a replica that Ray restarts after a crash
reports as a new one (its own process) beside the figures of the one that died.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass

import ray


@dataclass(frozen=True)
class BatchWork:
    """What one vacpack call over a batch cost: its tokens and the device's time on them."""

    num_real_tokens: int  # tokens run through the model for the batch's rows
    num_padding_tokens: int  # alignment tokens or padded slots run beside them
    num_bins: int  # packed forwards (corpus jobs) or engine steps (generation)
    device_busy_s: float
    elapsed_s: float  # wall time inside the vacpack call


@dataclass(frozen=True)
class ReplicaFigures:
    """One replica's running totals. Times in seconds, measured in the replica's process."""

    host: str
    pid: int  # a replica that Ray restarts is a new process, so a new entry
    task: str
    load_s: float  # loading the model, before the first batch
    num_batches: int = 0
    num_rows: int = 0
    num_failed: int = 0
    num_real_tokens: int = 0
    num_padding_tokens: int = 0
    num_bins: int = 0
    device_busy_s: float = 0.0
    in_calls_s: float = 0.0  # wall time inside vacpack's calls, summed over batches
    span_s: float = 0.0  # first batch's start to last batch's end, waits for input included
    peak_memory_bytes: int = 0

    def with_batch(
        self,
        num_rows: int,
        num_failed: int,
        work: BatchWork,
        span_s: float,
        peak_memory_bytes: int,
    ) -> ReplicaFigures:
        return dataclasses.replace(
            self,
            num_batches=self.num_batches + 1,
            num_rows=self.num_rows + num_rows,
            num_failed=self.num_failed + num_failed,
            num_real_tokens=self.num_real_tokens + work.num_real_tokens,
            num_padding_tokens=self.num_padding_tokens + work.num_padding_tokens,
            num_bins=self.num_bins + work.num_bins,
            device_busy_s=self.device_busy_s + work.device_busy_s,
            in_calls_s=self.in_calls_s + work.elapsed_s,
            span_s=span_s,
            peak_memory_bytes=max(self.peak_memory_bytes, peak_memory_bytes),
        )

    @property
    def replica(self) -> str:
        return replica_label(self.host, self.pid)

    @property
    def tokens_per_s(self) -> float:
        return self.num_real_tokens / max(self.span_s, 1e-9)

    @property
    def padding_overhead(self) -> float:
        """Padding tokens / all tokens processed."""
        total = self.num_real_tokens + self.num_padding_tokens
        return self.num_padding_tokens / total if total else 0.0

    @property
    def device_busy_fraction(self) -> float:
        """Over the replica's span: time spent waiting for Ray to hand it a batch counts idle."""
        return min(1.0, self.device_busy_s / max(self.span_s, 1e-9))

    def describe(self) -> str:
        return (
            f"{self.replica}: {self.num_rows} rows ({self.num_failed} failed) in "
            f"{self.num_batches} batches ({self.num_bins} forwards), {self.num_real_tokens:,} "
            f"tokens in {self.span_s:.2f} s = {self.tokens_per_s:,.0f} tokens/s, padding "
            f"{self.padding_overhead:.2%}, device busy {self.device_busy_fraction:.1%} (in "
            f"vacpack's calls {self.in_calls_s / max(self.span_s, 1e-9):.0%} of the span), "
            f"model load {self.load_s:.1f} s, peak memory {self.peak_memory_bytes / 2**30:.2f} GiB"
        )


def this_replica() -> tuple[str, int]:
    """(host, pid) of the calling process."""
    return socket.gethostname(), os.getpid()


def replica_label(host: str, pid: int) -> str:
    return f"{host} pid {pid}"


@dataclass(frozen=True)
class JobFigures:
    """The sum over replicas, seen from the driver."""

    replicas: tuple[ReplicaFigures, ...]
    wall_s: float  # the driver's whole job: start-up, reading, every replica, writing

    @property
    def num_rows(self) -> int:
        return sum(r.num_rows for r in self.replicas)

    @property
    def num_failed(self) -> int:
        return sum(r.num_failed for r in self.replicas)

    @property
    def num_real_tokens(self) -> int:
        return sum(r.num_real_tokens for r in self.replicas)

    @property
    def tokens_per_s(self) -> float:
        """Over the driver's wall time: what the cluster delivered, start-up included."""
        return self.num_real_tokens / max(self.wall_s, 1e-9)

    @property
    def replica_tokens_per_s(self) -> float:
        """The sum of the replicas' own rates: the cluster's speed once every replica runs."""
        return sum(r.tokens_per_s for r in self.replicas)

    @property
    def padding_overhead(self) -> float:
        padding = sum(r.num_padding_tokens for r in self.replicas)
        total = self.num_real_tokens + padding
        return padding / total if total else 0.0

    @property
    def device_busy_fraction(self) -> float:
        """Device-busy time over the replicas' spans, summed (a mean weighted by span)."""
        span_s = sum(r.span_s for r in self.replicas)
        return min(1.0, sum(r.device_busy_s for r in self.replicas) / max(span_s, 1e-9))

    def summary(self) -> str:
        task = self.replicas[0].task if self.replicas else "job"
        num_replicas = len(self.replicas)
        lines = [f"{task} on Ray, {num_replicas} replica{'s' if num_replicas != 1 else ''}:"]
        lines += [f"  {replica.describe()}" for replica in self.replicas]
        lines.append(
            f"  total: {self.num_rows} rows ({self.num_failed} failed), "
            f"{self.num_real_tokens:,} tokens in {self.wall_s:.2f} s = "
            f"{self.tokens_per_s:,.0f} tokens/s (replicas' rates summed: "
            f"{self.replica_tokens_per_s:,.0f} tokens/s), padding {self.padding_overhead:.2%}, "
            f"device busy {self.device_busy_fraction:.1%}"
        )
        return "\n".join(lines)


def job_figures(replicas: Sequence[ReplicaFigures], wall_s: float) -> JobFigures:
    return JobFigures(tuple(sorted(replicas, key=lambda r: (r.host, r.pid))), wall_s)


class FiguresCollector:
    """Holds the latest figures of every replica of one job (run as a Ray actor: see below)."""

    def __init__(self) -> None:
        self._latest: dict[tuple[str, int], ReplicaFigures] = {}

    def record(self, figures: ReplicaFigures) -> None:
        self._latest[figures.host, figures.pid] = figures

    def all(self) -> list[ReplicaFigures]:
        return list(self._latest.values())


# The collector as a Ray actor class, taking no CPU slot: `FiguresCollectorActor.remote()`.
FiguresCollectorActor = ray.remote(num_cpus=0)(FiguresCollector)
