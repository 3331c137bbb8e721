"""The step timeline: summaries over sequential and overlapped steps, the plot, `vacpack bench`."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vacpack.cli import main
from vacpack.cli.bench import parse_length_range
from vacpack.cpu_kernels import varlen_attention_supported
from vacpack.cpu_kernels.elementwise import elementwise_kernels_available
from vacpack.engine.timeline import (
    StepTimeline,
    StepTiming,
    steps_from_dict,
    summary_from_dict,
)
from vacpack.engine.timeline_plot import plot_timeline
from vacpack.models.cpu_dtype import DTYPES
from vacpack.models.layer_ops_choice import DECODER_LAYER_OP_PHASES
from vacpack.models.linear_choice import eligible_linear_kernels

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def timing(
    step_index: int,
    prepare: tuple[float, float],
    device: tuple[float, float],
    process: tuple[float, float],
    prefill_tokens: int = 0,
    decode_tokens: int = 4,
    padded_slots: int = 0,
) -> StepTiming:
    return StepTiming(
        step_index=step_index,
        prepare_start_s=prepare[0],
        launch_s=prepare[1],
        device_start_s=device[0],
        device_end_s=device[1],
        process_start_s=process[0],
        process_end_s=process[1],
        num_prefill_tokens=prefill_tokens,
        num_decode_tokens=decode_tokens,
        num_padded_slots=padded_slots,
        kv_pages_used=step_index + 1,
        kv_pages_total=100,
    )


def sequential_steps(num_steps: int) -> list[StepTiming]:
    """A synchronous engine: prepare 1, device 3, process 1 (in ms-like units of seconds)."""
    steps = []
    for index in range(num_steps):
        start = 5.0 * index
        steps.append(
            timing(index, (start, start + 1), (start + 1, start + 4), (start + 4, start + 5))
        )
    return steps


def timeline_of(steps: list[StepTiming], max_steps: int = 100_000) -> StepTimeline:
    timeline = StepTimeline(max_steps=max_steps)
    for step in steps:
        timeline.record(step)
    return timeline


def test_sequential_steps_busy_is_device_time_over_wall() -> None:
    summary = timeline_of(sequential_steps(4)).summary()
    assert summary.num_steps == 4
    assert summary.wall_s == pytest.approx(20.0)
    assert summary.device_busy_s == pytest.approx(12.0)
    assert summary.device_busy_fraction == pytest.approx(12.0 / 20.0)
    assert summary.host_prepare_s == pytest.approx(4.0)
    assert summary.host_process_s == pytest.approx(4.0)
    assert summary.mean_host_prepare_s == pytest.approx(1.0)
    # Between device spans lie this step's process and the next one's prepare.
    assert summary.idle_gap_s == pytest.approx(3 * 2.0)
    assert summary.mean_idle_gap_s == pytest.approx(2.0)


def test_overlapping_device_intervals_are_counted_once() -> None:
    steps = [
        timing(0, (0.0, 1.0), (1.0, 5.0), (5.0, 5.5)),
        timing(1, (1.0, 2.0), (4.0, 8.0), (8.0, 8.5)),  # overlaps step 0 on [4, 5]
        timing(2, (2.0, 3.0), (6.0, 7.0), (8.5, 9.0)),  # inside step 1
        timing(3, (8.5, 9.0), (10.0, 11.0), (11.0, 12.0)),  # after a gap of 2
    ]
    summary = timeline_of(steps).summary()
    assert summary.device_busy_s == pytest.approx(7.0 + 1.0)
    assert summary.idle_gap_s == pytest.approx(2.0)
    assert summary.wall_s == pytest.approx(12.0)
    assert summary.device_busy_fraction == pytest.approx(8.0 / 12.0)


def test_overlapped_engine_keeps_the_device_busy() -> None:
    # Step N+1 is prepared while step N computes and launched before step N's results are read,
    # so the device runs back to back and only the first prepare and last process are idle.
    steps = []
    for index in range(5):
        device_start = 1.0 + 3.0 * index
        steps.append(
            timing(
                index,
                (device_start - 1.0, device_start - 0.5),
                (device_start, device_start + 3.0),
                (device_start + 3.5, device_start + 4.0),
            )
        )
    summary = timeline_of(steps).summary()
    assert summary.idle_gap_s == pytest.approx(0.0)
    assert summary.device_busy_s == pytest.approx(15.0)
    assert summary.wall_s == pytest.approx(17.0)
    assert summary.device_busy_fraction == pytest.approx(15.0 / 17.0)


def test_ring_keeps_the_last_steps_but_totals_cover_all() -> None:
    steps = [
        timing(i, (5.0 * i, 5.0 * i + 1), (5.0 * i + 1, 5.0 * i + 4), (5.0 * i + 4, 5.0 * i + 5),
               prefill_tokens=10, decode_tokens=2, padded_slots=1)
        for i in range(10)
    ]  # fmt: skip
    timeline = timeline_of(steps, max_steps=3)
    assert [s.step_index for s in timeline.steps] == [7, 8, 9]
    summary = timeline.summary()
    assert summary.num_steps == 10
    assert summary.wall_s == pytest.approx(50.0)
    assert summary.device_busy_s == pytest.approx(30.0)
    assert summary.num_prefill_tokens == 100
    assert summary.num_decode_tokens == 20
    assert summary.num_padded_slots == 10
    assert summary.padded_share == pytest.approx(10 / 130)
    assert summary.peak_kv_pages_used == 10


def test_empty_and_reset() -> None:
    timeline = timeline_of(sequential_steps(3))
    timeline.reset()
    summary = timeline.summary()
    assert (summary.num_steps, summary.wall_s, summary.device_busy_fraction) == (0, 0.0, 0.0)
    assert timeline.steps == []
    assert summary.describe() == "no engine steps recorded"
    with pytest.raises(ValueError):
        StepTimeline(max_steps=0)


def test_to_dict_is_json_and_reads_back() -> None:
    timeline = timeline_of(sequential_steps(3))
    data = json.loads(json.dumps(timeline.to_dict()))
    assert steps_from_dict(data) == timeline.steps
    assert summary_from_dict(data) == timeline.summary()
    assert "device busy 60.0%" in timeline.summary().describe()


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert len(data) > 10_000


@pytest.mark.parametrize("window", ["start", "middle", "end"])
def test_plot_writes_a_png(tmp_path: Path, window: str) -> None:
    steps = sequential_steps(40)
    steps[0] = timing(0, (0.0, 1.0), (1.0, 4.0), (4.0, 5.0), prefill_tokens=30, decode_tokens=0)
    steps[1] = timing(1, (5.0, 6.0), (6.0, 9.0), (9.0, 10.0), prefill_tokens=9, padded_slots=3)
    timeline = timeline_of(steps)
    path = tmp_path / "plots" / "timeline.png"
    plot_timeline(timeline, path, title="synthetic", max_steps=10, window=window)  # type: ignore[arg-type]
    assert_png(path)


def test_plot_from_dict_and_of_nothing(tmp_path: Path) -> None:
    data = timeline_of(sequential_steps(5)).to_dict()
    plot_timeline(data, tmp_path / "from_dict.png")
    assert_png(tmp_path / "from_dict.png")
    with pytest.raises(ValueError, match="no steps"):
        plot_timeline(StepTimeline(), tmp_path / "empty.png")


def test_plotting_leaves_the_users_matplotlib_backend_alone(tmp_path: Path) -> None:
    code = (
        "import matplotlib\n"
        "matplotlib.use('svg')\n"
        "from vacpack.engine.timeline import StepTimeline, StepTiming\n"
        "from vacpack.engine.timeline_plot import plot_timeline\n"
        "timeline = StepTimeline()\n"
        "timeline.record(StepTiming(0, 0.0, 0.001, 0.001, 0.002, 0.002, 0.003, 4, 1, 0, 1, 8))\n"
        f"plot_timeline(timeline, {str(tmp_path / 'plot.png')!r})\n"
        "print(matplotlib.get_backend())\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "svg"
    assert (tmp_path / "plot.png").read_bytes()[:4] == b"\x89PNG"


def test_parse_length_range() -> None:
    assert parse_length_range("4:12") == (4, 12)
    assert parse_length_range("7") == (7, 7)
    for bad in ("12:4", "0:3", "a:b"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_length_range(bad)


def test_bench_audits_its_choices(
    tiny_checkpoint, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = tmp_path / "bench.json"
    argv = [
        "bench", "--model", str(tiny_checkpoint("qwen2")), "--device", "cpu", "--dtype", "float32",
        "--num-prompts", "2", "--input-len", "4:8", "--output-len", "2", "--json", str(report),
        "--quiet", "--no-warmup", "--audit-choices",
    ]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    results = json.loads(report.read_text())
    # Every timed choice (the load's and the engine's) audited once, all its candidates timed.
    chosen = {(c["phase"], c["shape_key"]): c for c in results["measured_choices"]}
    timed = {key for key, c in chosen.items() if c["best_time_s"]}
    audited = results["choice_audit"]
    assert {(row["phase"], row["shape_key"]) for row in audited} == timed
    for row in audited:
        choice = chosen[row["phase"], row["shape_key"]]
        assert row["chosen"] == choice["chosen"] and row["chosen_over_fastest"] >= 1.0
        assert set(row["best_time_s"]) | set(row["failed"]) == set(choice["best_time_s"]) | set(
            choice["failed"]
        )
    assert out.count("audit: ") == len(audited) > 0


def test_bench_writes_timeline_plot_and_json(
    tiny_checkpoint, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    png, report = tmp_path / "timeline.png", tmp_path / "bench.json"
    num_prompts, output_len = 4, 5
    model_dir = tiny_checkpoint("qwen3")
    head_dim = json.loads((model_dir / "config.json").read_text())["head_dim"]
    argv = [
        "bench", "--model", str(model_dir), "--device", "cpu",
        "--num-prompts", str(num_prompts), "--input-len", "4:12", "--output-len", str(output_len),
        "--timeline", str(png), "--json", str(report), "--quiet", "--no-warmup",
    ]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "device busy" in out
    # dtype auto on a CPU: bfloat16 or float32, timed at the model's shapes (or cached).
    assert "chosen by measurement: cpu_dtype" in out
    assert_png(png)
    results = json.loads(report.read_text())
    # The model's choices (its dtype, then its layer ops where fused kernels run for that
    # dtype, then its linears' kernel where the C kernel runs that dtype), then the engine's:
    # where the C attention kernel runs for that dtype, the backend for decodes first and for
    # prefill steps last; between them torch_sdpa's prefill and decode kernels (and the form of
    # a cascade's prefixes where the C kernel runs) and the cascade, behind each shared prefix
    # length timed.
    every_phase = [c["phase"] for c in results["measured_choices"]]
    phases = [phase for phase in every_phase if phase not in DECODER_LAYER_OP_PHASES]
    dtype = DTYPES[results["dtype"]]
    layer_ops = elementwise_kernels_available(torch.device("cpu"), dtype)
    layer_phases = list(DECODER_LAYER_OP_PHASES) if layer_ops else []
    assert every_phase[1 : 1 + len(layer_phases)] == layer_phases
    assert len(phases) == len(every_phase) - len(layer_phases)
    assert phases[0] == "cpu_dtype"
    engine_phases = phases[1:]
    if len(eligible_linear_kernels(torch.device("cpu"), dtype)) > 1:  # one per weight shape
        assert engine_phases[0] == "cpu_linear"
        while engine_phases[0] == "cpu_linear":
            engine_phases.pop(0)
    options = ["sdpa_prefill", "sdpa_decode"]
    if varlen_attention_supported(torch.device("cpu"), dtype, head_dim):
        assert engine_phases[0] == "attention_paged"
        assert engine_phases[-1] == "attention_paged_prefill"
        engine_phases = engine_phases[1:-1]
        options.append("cascade_prefix")  # the form of a cascade's shared prefixes
        # Read from the cache, a choice of the C kernel for decodes times no backend, so
        # torch_sdpa's options are not read or reported.
        decodes = next(c for c in results["measured_choices"] if c["phase"] == "attention_paged")
        if decodes["source"] == "cached" and decodes["chosen"] != "torch_sdpa":
            options = []
    assert engine_phases[: len(options)] == options
    cascades = engine_phases[len(options) :]
    assert cascades and set(cascades) == {"attention_cascade"}
    assert "chosen by measurement: attention_cascade" in out
    assert results["dtype"] == results["measured_choices"][0]["chosen"]
    assert results["num_output_tokens"] == num_prompts * output_len
    assert 4 * num_prompts <= results["num_prompt_tokens"] <= 12 * num_prompts
    steps = results["timeline"]["steps"]
    assert steps
    for step in steps:
        assert step["prepare_start_s"] <= step["launch_s"] <= step["device_start_s"]
        assert step["device_end_s"] >= step["device_start_s"]
        assert step["process_end_s"] >= step["process_start_s"] >= step["device_end_s"]
        assert 0 <= step["kv_pages_used"] <= step["kv_pages_total"]
    # Prompts shorter than a KV page share no cached prefix: every prompt token is computed.
    assert sum(s["num_prefill_tokens"] for s in steps) == results["num_prompt_tokens"]
    # The first output token comes from the prefill; each later one from one decode slot.
    num_decode = sum(s["num_decode_tokens"] for s in steps)
    assert num_prompts * (output_len - 1) <= num_decode <= num_prompts * output_len
    summary = results["timeline"]["summary"]
    assert summary["num_steps"] == len(steps)
    assert 0.0 < summary["device_busy_fraction"] <= 1.0


def test_generate_report_states_device_busy_fraction(
    tiny_checkpoint, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["generate", "--model", str(tiny_checkpoint("qwen3")), "--device", "cpu",
            "--prompt", "hello there", "--max-tokens", "3", "--quiet"]  # fmt: skip
    assert main(argv) == 0
    assert "device busy" in capsys.readouterr().err
