"""The per-step timeline: when the host prepared, the device computed and the host read results.

Every engine step hands one `StepTiming` to a `StepTimeline`. The timeline keeps the most recent
records (a server runs forever, so the record list is a ring) and running totals over every step
ever recorded, from which `summary()` derives the device-busy fraction, the idle gaps and the
padding share that every report states.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class StepTiming:
    """One engine step. Every time is on the host's time.perf_counter() clock, in seconds."""

    step_index: int
    prepare_start_s: float  # host starts scheduling and building the step's inputs
    launch_s: float  # host has handed the step to the device
    device_start_s: float  # device starts the step (CUDA events, or wall time on CPU)
    device_end_s: float
    process_start_s: float  # host starts reading the step's results (stop checks, outputs)
    process_end_s: float
    num_prefill_tokens: int
    num_decode_tokens: int
    num_padded_slots: int  # dummy slots a CUDA graph bucket added; counted, never hidden
    kv_pages_used: int
    kv_pages_total: int
    num_preempted: int = 0  # sequences preempted when the step was scheduled
    # Tensor parallel on a CPU (gloo): seconds rank 0's device work spent inside collectives
    # (all-reduces, LM-head gathers), waiting for the slower rank included. None without
    # tensor parallelism, and on NCCL, whose collectives run on the device without the host.
    collective_s: float | None = None
    # When the host filled the step's token masks (structured outputs); both 0 when it had none.
    # With async scheduling this runs after launch, while the device computes the forward.
    mask_fill_start_s: float = 0.0
    mask_fill_end_s: float = 0.0

    @property
    def mask_fill_s(self) -> float:
        return self.mask_fill_end_s - self.mask_fill_start_s

    @property
    def prepare_s(self) -> float:
        return self.launch_s - self.prepare_start_s

    @property
    def device_s(self) -> float:
        return self.device_end_s - self.device_start_s

    @property
    def process_s(self) -> float:
        return self.process_end_s - self.process_start_s

    @property
    def num_tokens(self) -> int:
        """Real tokens the step computed; padded slots are not tokens."""
        return self.num_prefill_tokens + self.num_decode_tokens


@dataclass(frozen=True)
class TimelineSummary:
    """Totals over every recorded step (not only the kept ones). Times in seconds."""

    num_steps: int
    wall_s: float  # first step's prepare_start to last step's process_end
    device_busy_s: float  # union of device intervals: overlapping steps count once
    device_busy_fraction: float  # device_busy_s / wall_s
    host_prepare_s: float
    host_process_s: float
    mean_host_prepare_s: float  # per step
    mean_host_process_s: float  # per step
    idle_gap_s: float  # device idle between consecutive device intervals, summed
    mean_idle_gap_s: float  # idle_gap_s over the num_steps - 1 transitions between steps
    num_prefill_tokens: int
    num_decode_tokens: int
    num_padded_slots: int
    padded_share: float  # padded slots / (real tokens + padded slots)
    peak_kv_pages_used: int
    kv_pages_total: int  # as of the last step
    host_mask_fill_s: float = 0.0  # filling token masks (structured outputs), summed

    def describe(self) -> str:
        """One line for a report: how busy the device was and what the host spent per step."""
        if self.num_steps == 0:
            return "no engine steps recorded"
        masks = ""
        if self.host_mask_fill_s > 0:
            masks = f"token masks {self.host_mask_fill_s / self.num_steps * 1e3:.2f} ms/step, "
        return (
            f"{self.num_steps} steps, device busy {self.device_busy_fraction:.1%}, "
            f"mean idle gap {self.mean_idle_gap_s * 1e3:.2f} ms, "
            f"host prepare {self.mean_host_prepare_s * 1e3:.2f} ms/step, "
            f"process {self.mean_host_process_s * 1e3:.2f} ms/step, {masks}"
            f"padded slots {self.padded_share:.1%}"
        )


def _empty_summary() -> TimelineSummary:
    return TimelineSummary(
        num_steps=0,
        wall_s=0.0,
        device_busy_s=0.0,
        device_busy_fraction=0.0,
        host_prepare_s=0.0,
        host_process_s=0.0,
        mean_host_prepare_s=0.0,
        mean_host_process_s=0.0,
        idle_gap_s=0.0,
        mean_idle_gap_s=0.0,
        num_prefill_tokens=0,
        num_decode_tokens=0,
        num_padded_slots=0,
        padded_share=0.0,
        peak_kv_pages_used=0,
        kv_pages_total=0,
    )


class StepTimeline:
    """Keeps the last `max_steps` step records; running totals cover every step recorded.

    Device intervals are merged on the fly, which needs steps recorded in the order the device
    started them. That is the order of a single device stream, and the order every engine loop
    records in, even when the host overlaps step N+1's prepare with step N's compute.
    """

    def __init__(self, max_steps: int = 100_000) -> None:
        if max_steps < 1:
            raise ValueError(f"max_steps must be at least 1, got {max_steps}")
        self.max_steps = max_steps
        # The engine thread records while a server's request thread may summarise.
        self._lock = threading.Lock()
        self._steps: deque[StepTiming] = deque(maxlen=max_steps)
        self._reset_totals()

    def _reset_totals(self) -> None:
        self._num_steps = 0
        self._first_prepare_start_s = float("inf")
        self._last_process_end_s = float("-inf")
        self._device_busy_s = 0.0
        self._idle_gap_s = 0.0
        # End of the union of device intervals seen so far; None before the first step.
        self._device_frontier_s: float | None = None
        self._host_prepare_s = 0.0
        self._host_process_s = 0.0
        self._num_prefill_tokens = 0
        self._num_decode_tokens = 0
        self._num_padded_slots = 0
        self._peak_kv_pages_used = 0
        self._kv_pages_total = 0
        self._host_mask_fill_s = 0.0

    def reset(self) -> None:
        """Forget every record and total, e.g. so a benchmark measures only its timed run."""
        with self._lock:
            self._steps.clear()
            self._reset_totals()

    def record(self, timing: StepTiming) -> None:
        with self._lock:
            self._steps.append(timing)
            self._num_steps += 1
            self._first_prepare_start_s = min(self._first_prepare_start_s, timing.prepare_start_s)
            self._last_process_end_s = max(self._last_process_end_s, timing.process_end_s)
            self._merge_device_interval(timing.device_start_s, timing.device_end_s)
            self._host_prepare_s += max(0.0, timing.prepare_s)
            self._host_process_s += max(0.0, timing.process_s)
            self._num_prefill_tokens += timing.num_prefill_tokens
            self._num_decode_tokens += timing.num_decode_tokens
            self._num_padded_slots += timing.num_padded_slots
            self._peak_kv_pages_used = max(self._peak_kv_pages_used, timing.kv_pages_used)
            self._kv_pages_total = timing.kv_pages_total
            self._host_mask_fill_s += max(0.0, timing.mask_fill_s)

    def _merge_device_interval(self, start_s: float, end_s: float) -> None:
        frontier_s = self._device_frontier_s
        if frontier_s is None:
            self._device_busy_s += max(0.0, end_s - start_s)
            self._device_frontier_s = end_s
            return
        if start_s >= frontier_s:
            # A gap between this step and everything before it: the device sat idle.
            self._idle_gap_s += start_s - frontier_s
            self._device_busy_s += max(0.0, end_s - start_s)
        else:
            # Overlaps the previous work: only the part past the frontier is new busy time.
            self._device_busy_s += max(0.0, end_s - frontier_s)
        self._device_frontier_s = max(frontier_s, end_s)

    @property
    def steps(self) -> list[StepTiming]:
        """The kept records, oldest first."""
        with self._lock:
            return list(self._steps)

    @property
    def num_steps(self) -> int:
        """Steps recorded since the start (or the last reset), kept or not."""
        return self._num_steps

    def summary(self) -> TimelineSummary:
        with self._lock:
            n = self._num_steps
            if n == 0:
                return _empty_summary()
            wall_s = max(0.0, self._last_process_end_s - self._first_prepare_start_s)
            real_tokens = self._num_prefill_tokens + self._num_decode_tokens
            slots = real_tokens + self._num_padded_slots
            return TimelineSummary(
                num_steps=n,
                wall_s=wall_s,
                device_busy_s=self._device_busy_s,
                device_busy_fraction=min(1.0, self._device_busy_s / wall_s) if wall_s > 0 else 0.0,
                host_prepare_s=self._host_prepare_s,
                host_process_s=self._host_process_s,
                mean_host_prepare_s=self._host_prepare_s / n,
                mean_host_process_s=self._host_process_s / n,
                idle_gap_s=self._idle_gap_s,
                mean_idle_gap_s=self._idle_gap_s / (n - 1) if n > 1 else 0.0,
                num_prefill_tokens=self._num_prefill_tokens,
                num_decode_tokens=self._num_decode_tokens,
                num_padded_slots=self._num_padded_slots,
                padded_share=self._num_padded_slots / slots if slots else 0.0,
                peak_kv_pages_used=self._peak_kv_pages_used,
                kv_pages_total=self._kv_pages_total,
                host_mask_fill_s=self._host_mask_fill_s,
            )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the summary (over all steps) and the kept per-step records."""
        return {
            "summary": asdict(self.summary()),
            "steps": [asdict(step) for step in self.steps],
        }


def steps_from_dict(data: dict[str, Any]) -> list[StepTiming]:
    """The per-step records of a `StepTimeline.to_dict()` result, e.g. read back from JSON."""
    return [StepTiming(**step) for step in data.get("steps", [])]


def summary_from_dict(data: dict[str, Any]) -> TimelineSummary:
    return TimelineSummary(**data["summary"])
