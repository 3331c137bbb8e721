"""Workload S1: `vacpack serve` against `transformers serve` under concurrent streaming clients.

Both servers serve one checkpoint in bfloat16 and get the same load, one after the other in
one run: at each concurrency level (16 and 64), that many closed-loop clients each stream one
/v1/completions request after another until `--num-requests` are done. Prompts are text made
of random tokens, about uniform in [32, 1024] tokens long (seeded, fresh for every level so
the prefix cache cannot serve a later level from an earlier one, the same for both servers);
64 greedy output tokens each with EOS ignored (vacpack: `ignore_eos`; transformers: a
`generation_config` of `eos_token_id: -1`). Reported per level and server, all measured by the
clients: requests/s, output tokens/s, time to first token (TTFT), time per output token after
the first (TPOT), and the gaps between streamed chunks (ITL), p50 and p99; and the ratios.

The checkpoint is G1's random-weight model with the exact shapes of Qwen2.5-0.5B, with one
change (built once beside it): the embedding rows (the tied LM head) of every id that does not
decode to clean text on its own are zero. Its tokenizer knows 2,048 of the 151,936 ids, so
unchanged it would emit mostly ids that stream no text, and `transformers serve` streams only
text: no client could see its first token. With those rows zero their logit is 0 while the
decodable ids' are random around 0, so greedy decoding picks a decodable id every time; the
shapes and therefore the work are unchanged.

`transformers serve` needs `accelerate` (pip install -e ".[bench]"); where it cannot run, the
results say why. It runs with --continuous-batching by default (paged sdpa attention, the same
2,048-token step budget as vacpack on CPU, 256-token pages, enough pages for every client's
request at full length), which in a smoke probe on this CPU (4 clients, 8 requests) gave it
more throughput and a shorter TTFT than its plain `generate` path, one request at a time
(`--transformers-mode sequential`). Neither server gets --compile.

Full run (vacpack about 10 minutes on a 2-core CPU, transformers serve longer; do not run it on
a shared machine):
    python bench/s1_server.py
Quick check that everything works (a tiny model, a few seconds per server):
    python bench/s1_server.py --model-dir DIR --dtype float32 --concurrency 2,4 \
        --num-requests 8 --min-prompt-len 8 --max-prompt-len 64 --max-tokens 8 \
        --output bench/results/tmp/s1_small.json --plot bench/results/tmp/s1_small.png
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import checkpoints
import httpx
from harness import (
    machine_description,
    markdown_cell,
)
from process_timing import timed_section
from s1_client import level_fields, request_body, run_level
from s1_report import markdown_table, save_plot, speedups
from s1_workload import (
    LOOPBACK,
    PROMPT_SEED,
    SYSTEMS,
    ServerSpec,
    ensure_decodable_checkpoint,
    log,
    make_prompts,
    num_prompt_tokens,
    transformers_serve_missing,
    transformers_serve_spec,
    vacpack_spec,
)
from workers import publish_results

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUTPUT_PATH = REPO_ROOT / "bench" / "results" / "s1_server_cpu.json"
SERVER_STARTUP_TIMEOUT_S = 600.0
SERVER_STOP_TIMEOUT_S = 60.0
LOG_TAIL_CHARS = 2000


# ---------------------------------------------------------------------------- the servers


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        return probe.getsockname()[1]


def start_server(spec: ServerSpec, base_url: str, log_path: Path) -> subprocess.Popen[bytes]:
    with log_path.open("wb") as server_log:
        process = subprocess.Popen(spec.command, stdout=server_log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + SERVER_STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"{spec.name} exited with code {process.returncode} before it was healthy; "
                f"its log ends: {log_tail(log_path)}"
            )
        try:
            if httpx.get(f"{base_url}/health", timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"{spec.name} was not healthy after {SERVER_STARTUP_TIMEOUT_S} s")


def stop_server(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(SERVER_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def log_tail(log_path: Path) -> str:
    return markdown_cell(log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:])


# ---------------------------------------------------------------------------- one system


def run_system(
    spec: ServerSpec,
    base_url: str,
    args: argparse.Namespace,
    model_dir: Path,
    prompts_per_level: list[list[str]],
) -> dict[str, Any]:
    log_path = args.output.with_name(f"{args.output.stem}.{spec.name}.server.log")
    log(f"{spec.name}: starting the server (log: {log_path})")
    process = start_server(spec, base_url, log_path)
    try:
        # Untimed: transformers sets up its continuous batching on the first request.
        warmup = request_body(spec, model_dir, "warm up", max_tokens=2)
        asyncio.run(run_level(base_url, [warmup], concurrency=1))
        levels = []
        for concurrency, prompts in zip(args.concurrency, prompts_per_level, strict=True):
            log(f"{spec.name}: {concurrency} concurrent clients, {len(prompts)} requests")
            bodies = [request_body(spec, model_dir, p, args.max_tokens) for p in prompts]
            with timed_section() as section:
                timings = asyncio.run(run_level(base_url, bodies, concurrency))
            level = level_fields(concurrency, timings, section.wall_s, args.max_tokens)
            level.update(section.fields())
            levels.append(level)
    finally:
        stop_server(process)
    return {**spec.settings, "levels": levels}


def run_system_catching_errors(run: Callable[[], dict[str, Any]], name: str) -> dict[str, Any]:
    try:
        return run()
    except Exception as error:
        log(f"{name} failed: {error}")
        return {"error": f"{type(error).__name__}: {error}"}


# ---------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    source_dir = checkpoints.ensure_qwen2_5_0_5b_shapes_checkpoint(args.model_dir, "s1")
    model_dir = ensure_decodable_checkpoint(source_dir)
    prompts_per_level = [
        make_prompts(
            model_dir, args.num_requests, args.min_prompt_len, args.max_prompt_len, PROMPT_SEED + i
        )
        for i in range(len(args.concurrency))
    ]
    prompt_lens_per_level = [num_prompt_tokens(model_dir, p) for p in prompts_per_level]
    # Room for the longest prompt, its output, and special tokens a server's tokenizer may add.
    max_model_len = max(map(max, prompt_lens_per_level)) + args.max_tokens + 16
    args.output.parent.mkdir(parents=True, exist_ok=True)

    systems: dict[str, Any] = {}
    for name in args.systems:
        port = free_port()
        base_url = f"http://{LOOPBACK}:{port}"
        if name == "vacpack":
            spec = vacpack_spec(args, model_dir, max_model_len, port)
        else:
            missing = transformers_serve_missing()
            if missing:
                log(missing)
                systems[name] = {"error": missing}
                continue
            spec = transformers_serve_spec(args, model_dir, max_model_len, port)
        systems[name] = run_system_catching_errors(
            lambda spec=spec, base_url=base_url: run_system(
                spec, base_url, args, model_dir, prompts_per_level
            ),
            name,
        )

    results: dict[str, Any] = {
        "workload": {
            "name": "S1",
            "model_dir": str(model_dir),
            "source_model_dir": str(source_dir),
            "dtype": args.dtype,
            "concurrency": args.concurrency,
            "num_requests": args.num_requests,
            "min_prompt_len": args.min_prompt_len,
            "max_prompt_len": args.max_prompt_len,
            "num_prompt_tokens_per_level": [sum(lens) for lens in prompt_lens_per_level],
            "max_tokens": args.max_tokens,
            "greedy": True,
            "ignore_eos": True,
        },
        "machine": machine_description(),
        "systems": systems,
    }
    results["speedups"] = speedups(results)
    publish_results(results, args.output, args.plot, save_plot, markdown_table(results), "s1")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=checkpoints.QWEN2_5_0_5B_SHAPES_DIR)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--concurrency",
        type=lambda text: [int(c) for c in text.split(",")],
        default=[16, 64],
        help="comma-separated client counts",
    )
    parser.add_argument("--num-requests", type=int, default=128, help="per concurrency level")
    parser.add_argument("--min-prompt-len", type=int, default=32)
    parser.add_argument("--max-prompt-len", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument(
        "--systems",
        type=lambda text: text.split(","),
        default=list(SYSTEMS),
        help=f"comma-separated, of {','.join(SYSTEMS)}",
    )
    parser.add_argument(
        "--transformers-mode",
        choices=("continuous-batching", "sequential"),
        default="continuous-batching",
    )
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT_PATH)
    parser.add_argument("--plot", type=Path, default=None, help="default: --output as .png")
    args = parser.parse_args(argv)
    if not 1 <= args.min_prompt_len <= args.max_prompt_len:
        parser.error("need 1 <= --min-prompt-len <= --max-prompt-len")
    if unknown := set(args.systems) - set(SYSTEMS):
        parser.error(f"unknown systems {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    return args


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
