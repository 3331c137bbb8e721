"""Where a steady decode step's time goes, host and device: cProfile and torch.profiler over an
engine's steps, not a benchmark. O1's shapes by default (Qwen2.5-0.5B-shaped random weights, 256
requests of 32..1,024 prompt tokens); the steps profiled come after every prefill, so each is a
decode of the whole batch.

Writes DIR/profile.txt (the host's functions by cumulative and by own time, then the ops by
device time and by host time) and DIR/trace.json (open it in chrome://tracing or Perfetto).

    python bench/profile_steps.py --device cuda --output-dir bench/results/tmp/profile
    python bench/profile_steps.py --device cpu --dtype float32 --num-requests 8 \
        --max-prompt-len 64 --steps 6 --output-dir bench/results/tmp/profile
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from pathlib import Path

import checkpoints
import harness
import torch
from torch.profiler import ProfilerActivity, profile

from vacpack import LLM, SamplingParams

TABLE_ROWS = 40


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--model-dir", type=Path, default=checkpoints.QWEN2_5_0_5B_SHAPES_DIR)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--min-prompt-len", type=int, default=32)
    parser.add_argument("--max-prompt-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=30, help="decode steps profiled")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--output-dir", type=Path, required=True)
    args = parser.parse_args()
    device = harness.resolve_device(args.device)
    model_dir = checkpoints.ensure_qwen2_5_0_5b_shapes_checkpoint(args.model_dir, "profile")
    llm = LLM(str(model_dir), dtype=args.dtype, device=device, max_num_seqs=args.num_requests)
    engine = llm.engine
    vocab_size = llm.loaded.config.vocab_size
    prompts = harness.random_token_prompts(
        args.num_requests, args.min_prompt_len, args.max_prompt_len, vocab_size, seed=7
    )
    warmup = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate(prompts[:4], warmup, use_tqdm=False)  # kernels compiled, graphs captured
    # Long enough to outlast the prefills and every profiled step.
    params = SamplingParams(temperature=0, max_tokens=4 * args.steps + 64, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        engine.add_request(f"profiled-{index}", prompt, params)
    while engine.scheduler.waiting or _prefilling(engine):
        engine.step()
    for _ in range(4):  # past the last prefill's step in flight
        engine.step()

    report = io.StringIO()
    host_profile = cProfile.Profile()
    start_s = time.perf_counter()
    host_profile.enable()
    for _ in range(args.steps):
        engine.step()
    host_profile.disable()
    report.write(f"{args.steps} steps under cProfile: {time.perf_counter() - start_s:.3f} s\n")
    start_s = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    if device == "cuda":
        torch.cuda.synchronize()
    report.write(f"{args.steps} steps, no profiler: {time.perf_counter() - start_s:.3f} s\n\n")
    for order in ("cumulative", "tottime"):
        pstats.Stats(host_profile, stream=report).sort_stats(order).print_stats(TABLE_ROWS)

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as op_profile:
        for _ in range(args.steps // 3):
            engine.step()
        if device == "cuda":
            torch.cuda.synchronize()
    averages = op_profile.key_averages()
    device_key = "cuda_time_total" if device == "cuda" else "cpu_time_total"
    report.write(averages.table(sort_by=device_key, row_limit=TABLE_ROWS))
    report.write(averages.table(sort_by="self_cpu_time_total", row_limit=TABLE_ROWS))
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "profile.txt").write_text(report.getvalue())
    op_profile.export_chrome_trace(str(args.output_dir / "trace.json"))
    summary = engine.timeline.summary()
    harness.log(
        f"wrote {args.output_dir}/profile.txt and trace.json; timeline: device busy "
        f"{summary.device_busy_fraction:.1%}, host prepare {summary.mean_host_prepare_s * 1e3:.2f}"
        f" ms/step, process {summary.mean_host_process_s * 1e3:.2f} ms/step",
        "profile",
    )


def _prefilling(engine) -> bool:
    return any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running)


if __name__ == "__main__":
    main()
