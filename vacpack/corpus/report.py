"""What a corpus job reports: throughput, padding overhead, peak memory, device-busy share."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from vacpack.host_memory import host_peak_memory_bytes
from vacpack.tuning import MeasuredChoice


@dataclass
class JobReport:
    task: str
    num_documents: int = 0
    num_failed: int = 0
    num_bins: int = 0
    num_real_tokens: int = 0  # document tokens run through the model
    num_padding_tokens: int = 0  # alignment tokens run through the model
    device_busy_s: float = 0.0  # forwards and their post-processing
    wait_for_bins_s: float = 0.0  # the device idle, waiting on the packer
    failures: list[tuple[int, str]] = field(default_factory=list)
    start_s: float = field(default_factory=time.perf_counter)
    end_s: float | None = None
    peak_memory_bytes: int = 0
    bin_budget_tokens: int = 0
    budget_source: str = ""
    # What the model's load chose by measurement (e.g. the dtype), with the timings.
    measured_choices: tuple[MeasuredChoice, ...] = ()

    def finish(self, device: torch.device) -> None:
        self.end_s = time.perf_counter()
        if device.type == "cuda":
            self.peak_memory_bytes = torch.cuda.max_memory_allocated(device)
        else:
            self.peak_memory_bytes = host_peak_memory_bytes()

    @property
    def elapsed_s(self) -> float:
        return (self.end_s or time.perf_counter()) - self.start_s

    @property
    def tokens_per_s(self) -> float:
        return self.num_real_tokens / max(self.elapsed_s, 1e-9)

    @property
    def documents_per_s(self) -> float:
        return self.num_documents / max(self.elapsed_s, 1e-9)

    @property
    def padding_overhead(self) -> float:
        """Padding tokens / all tokens processed."""
        total = self.num_real_tokens + self.num_padding_tokens
        return self.num_padding_tokens / total if total else 0.0

    @property
    def device_busy_fraction(self) -> float:
        return min(1.0, self.device_busy_s / max(self.elapsed_s, 1e-9))

    def summary(self) -> str:
        lines = [
            f"{self.task}: {self.num_documents} documents ({self.num_failed} failed) in "
            f"{self.elapsed_s:.2f} s, {self.num_bins} bins of at most {self.bin_budget_tokens} "
            f"tokens ({self.budget_source})",
            f"  {self.tokens_per_s:,.0f} tokens/s, {self.documents_per_s:,.1f} documents/s, "
            f"padding {self.padding_overhead:.2%}, "
            f"peak memory {self.peak_memory_bytes / 2**30:.2f} GiB, "
            f"device busy {self.device_busy_fraction:.1%}",
        ]
        lines += [f"  chosen by measurement: {c.summary()}" for c in self.measured_choices]
        # Failures are recorded as their bins finish; listed in input order.
        failures = sorted(self.failures)
        lines += [f"  failed: document {index}: {message}" for index, message in failures]
        return "\n".join(lines)
