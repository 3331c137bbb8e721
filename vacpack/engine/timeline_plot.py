"""Draws a step timeline as a two-lane chart: what the host did, and what the device did, when.

The host lane shows each step's prepare span (scheduling, building inputs) and its process span
(reading sampled tokens, stop checks, outputs); the device lane shows each step's compute span,
coloured by what the batch held. Gaps in the device lane are time the device sat idle. An optional
lower panel stacks the tokens each step computed, aligned on the same time axis.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from matplotlib.axes import Axes
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from vacpack.engine.timeline import (
    StepTimeline,
    StepTiming,
    TimelineSummary,
    steps_from_dict,
    summary_from_dict,
)

Window = Literal["start", "middle", "end"]

PREPARE_COLOR = "#4C72B0"
PROCESS_COLOR = "#DD8452"
DECODE_COLOR = "#55A868"
MIXED_COLOR = "#8172B3"
PREFILL_COLOR = "#C44E52"
PADDED_COLOR = "#BBBBBB"
MASK_COLOR = "#CCB974"

_HOST_Y = 1.0
_DEVICE_Y = 0.0
_LANE_HEIGHT = 0.6


def plot_timeline(
    timeline_or_dict: StepTimeline | dict[str, Any],
    path: str | Path,
    title: str | None = None,
    max_steps: int | None = None,
    window: Window = "middle",
    show_tokens: bool = True,
) -> None:
    """Writes the chart to `path` (the format follows its suffix, e.g. .png or .svg).

    A long run has thousands of steps, too many to see one span from the next, so `max_steps`
    plots a window of that many consecutive steps: from the start, the middle (the steady
    state, the default) or the end of the kept records.
    """
    steps, whole_run = _steps_and_summary(timeline_or_dict)
    if not steps:
        raise ValueError("the timeline has no steps to plot")
    shown = _window(steps, max_steps, window)
    origin_s = shown[0].prepare_start_s

    fig, axes = _figure(show_tokens)
    lanes = axes[0]
    _draw_lanes(lanes, shown, origin_s)
    if show_tokens:
        _draw_tokens(axes[1], shown, origin_s)
    axes[-1].set_xlabel(f"time since step {shown[0].step_index} started (ms)")
    fig.suptitle(title or "vacpack step timeline", fontsize=13, fontweight="bold")
    lanes.set_title(_subtitle(shown, whole_run), fontsize=10, loc="left")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150)


def _steps_and_summary(
    timeline_or_dict: StepTimeline | dict[str, Any],
) -> tuple[list[StepTiming], TimelineSummary]:
    if isinstance(timeline_or_dict, StepTimeline):
        return timeline_or_dict.steps, timeline_or_dict.summary()
    return steps_from_dict(timeline_or_dict), summary_from_dict(timeline_or_dict)


def _window(steps: list[StepTiming], max_steps: int | None, window: Window) -> list[StepTiming]:
    if max_steps is None or len(steps) <= max_steps:
        return steps
    if max_steps < 1:
        raise ValueError(f"max_steps must be at least 1, got {max_steps}")
    first = {"start": 0, "middle": (len(steps) - max_steps) // 2, "end": len(steps) - max_steps}
    if window not in first:
        raise ValueError(f"window must be start, middle or end, got {window!r}")
    return steps[first[window] : first[window] + max_steps]


def _figure(show_tokens: bool) -> tuple[Figure, list[Axes]]:
    # A bare Figure, never pyplot: no global figure registry, and the user's backend (an
    # interactive one in a notebook) is left as it was; savefig renders with Agg by itself.
    if not show_tokens:
        fig = Figure(figsize=(14, 3.4), layout="constrained")
        return fig, [fig.subplots()]
    fig = Figure(figsize=(14, 6), layout="constrained")
    lanes, tokens = fig.subplots(2, 1, sharex=True, height_ratios=[1.1, 1])
    return fig, [lanes, tokens]


def _batch_color(step: StepTiming) -> str:
    if step.num_prefill_tokens == 0:
        return DECODE_COLOR
    if step.num_decode_tokens == 0:
        return PREFILL_COLOR
    return MIXED_COLOR


def _lighter(color: str, amount: float) -> tuple[float, float, float]:
    """`color` mixed with white: 0 keeps it, 1 is white."""
    red, green, blue = to_rgb(color)
    return red + (1.0 - red) * amount, green + (1.0 - green) * amount, blue + (1.0 - blue) * amount


def _ms(seconds: float) -> float:
    return seconds * 1e3


def _draw_lanes(ax: Axes, steps: list[StepTiming], origin_s: float) -> None:
    def span(start_s: float, end_s: float) -> tuple[float, float]:
        return _ms(start_s - origin_s), _ms(max(0.0, end_s - start_s))

    bottom = -_LANE_HEIGHT / 2
    ax.broken_barh(
        [span(s.prepare_start_s, s.launch_s) for s in steps],
        (_HOST_Y + bottom, _LANE_HEIGHT),
        facecolors=PREPARE_COLOR,
    )
    ax.broken_barh(
        [span(s.process_start_s, s.process_end_s) for s in steps],
        (_HOST_Y + bottom, _LANE_HEIGHT),
        facecolors=PROCESS_COLOR,
    )
    # Token masks (structured outputs), drawn over the host lane's other spans: within prepare
    # when filled before launch, after it when filled while the device runs the forward.
    masked = [s for s in steps if s.mask_fill_end_s > 0]
    ax.broken_barh(
        [span(s.mask_fill_start_s, s.mask_fill_end_s) for s in masked],
        (_HOST_Y + bottom / 2, _LANE_HEIGHT / 2),
        facecolors=MASK_COLOR,
    )
    # Every other device span a little lighter, so back-to-back steps still read as separate.
    ax.broken_barh(
        [span(s.device_start_s, s.device_end_s) for s in steps],
        (_DEVICE_Y + bottom, _LANE_HEIGHT),
        facecolors=[_lighter(_batch_color(s), 0.3 if i % 2 else 0.0) for i, s in enumerate(steps)],
    )
    ax.set_yticks([_DEVICE_Y, _HOST_Y], ["device", "host"], fontsize=11)
    ax.set_ylim(_DEVICE_Y - 0.6, _HOST_Y + 0.6)
    ax.set_xlim(0.0, _ms(max(s.process_end_s for s in steps) - origin_s))
    ax.grid(axis="x", color="#DDDDDD", linewidth=0.6)
    ax.set_axisbelow(True)
    ax.tick_params(axis="y", length=0)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    legend = [
        Patch(color=PREPARE_COLOR, label="host: prepare"),
        Patch(color=PROCESS_COLOR, label="host: process results"),
        Patch(color=DECODE_COLOR, label="device: decode-only step"),
        Patch(color=MIXED_COLOR, label="device: mixed step"),
        Patch(color=PREFILL_COLOR, label="device: prefill-only step"),
    ]
    if masked:
        legend.insert(2, Patch(color=MASK_COLOR, label="host: token masks"))
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.005, 1.0), frameon=False)


def _draw_tokens(ax: Axes, steps: list[StepTiming], origin_s: float) -> None:
    # Bars span each step's device interval, so they line up with the device lane above.
    lefts = [_ms(s.device_start_s - origin_s) for s in steps]
    widths = [_ms(max(s.device_s, 0.0)) for s in steps]
    decode = [s.num_decode_tokens for s in steps]
    prefill = [s.num_prefill_tokens for s in steps]
    padded = [s.num_padded_slots for s in steps]
    stacked = [d + p for d, p in zip(decode, prefill, strict=True)]
    for heights, bottoms, color, label in (
        (decode, None, DECODE_COLOR, "decode tokens"),
        (prefill, decode, PREFILL_COLOR, "prefill tokens"),
        (padded, stacked, PADDED_COLOR, "padded slots"),
    ):
        ax.bar(
            lefts, heights, widths, bottom=bottoms, align="edge", linewidth=0, color=color,
            label=label,
        )  # fmt: skip
    ax.set_ylabel("tokens per step")
    ax.grid(axis="both", color="#DDDDDD", linewidth=0.6)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), frameon=False)


def _subtitle(shown: list[StepTiming], whole_run: TimelineSummary) -> str:
    window = StepTimeline(max_steps=len(shown))
    for step in shown:
        window.record(step)
    part = window.summary()
    scope = (
        f"steps {shown[0].step_index}-{shown[-1].step_index}"
        if part.num_steps < whole_run.num_steps
        else f"all {part.num_steps} steps"
    )
    text = (
        f"{scope}: device busy {part.device_busy_fraction:.1%}, "
        f"mean idle gap {_ms(part.mean_idle_gap_s):.2f} ms, "
        f"host prepare {_ms(part.mean_host_prepare_s):.2f} ms/step, "
        f"process {_ms(part.mean_host_process_s):.2f} ms/step"
    )
    if part.num_steps < whole_run.num_steps:
        text += (
            f"\nwhole run ({whole_run.num_steps} steps): "
            f"device busy {whole_run.device_busy_fraction:.1%}"
        )
    return text
