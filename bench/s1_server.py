"""Workload S1: vacpack's OpenAI server under concurrent streaming clients.

S1 serves a random-weight model with the exact shapes of Qwen2.5-0.5B in bfloat16 (G1's
checkpoint) with `vacpack serve`, and drives it with closed-loop clients: at each concurrency
level (16 and 64), that many clients each stream one /v1/completions request after another
until `--num-requests` are done. Prompts are random token ids with lengths uniform in
[32, 1024] (seeded), 64 greedy output tokens each with EOS ignored. Reported per level:
requests/s, output tokens/s, time to first token (TTFT) p50/p99 and inter-token latency (ITL)
p50/p99, all measured by the clients.

Each request asks for `logprobs: 0`, so every streamed chunk says how many tokens it carries:
the random model's tokens mostly decode to no text, and chunks without text are not sent.

transformers serve is not run: on this machine it stops at model loading, asking for
`accelerate`, which is not installed (and not a dependency we take on for a benchmark).

Full run (about 10 minutes on a 2-core CPU; do not run it on a shared machine):
    python bench/s1_server.py
Quick check that everything works (a tiny model, a few seconds):
    python bench/s1_server.py --model-dir DIR --dtype float32 --concurrency 2,4 \
        --num-requests 8 --min-prompt-len 8 --max-prompt-len 64 --max-tokens 8 \
        --output bench/results/tmp/s1_small.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import harness
import httpx
import torch
from harness import machine_description

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUTPUT_PATH = REPO_ROOT / "bench" / "results" / "s1_server_cpu.json"
PROMPT_SEED = 0
LOOPBACK = "127.0.0.1"
SERVER_STARTUP_TIMEOUT_S = 600.0


def log(message: str) -> None:
    harness.log(message, "s1")


def make_prompts(
    num_prompts: int, min_prompt_len: int, max_prompt_len: int, vocab_size: int, seed: int
) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(
        min_prompt_len, max_prompt_len + 1, (num_prompts,), generator=generator
    )
    return [
        torch.randint(0, vocab_size, (int(n),), generator=generator).tolist() for n in prompt_lens
    ]


# ---------------------------------------------------------------------------- the server


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        return probe.getsockname()[1]


def start_server(args: argparse.Namespace, port: int, log_path: Path) -> subprocess.Popen[bytes]:
    command = [
        sys.executable, "-m", "vacpack", "serve",
        "--model", str(args.model_dir), "--dtype", args.dtype,
        "--host", LOOPBACK, "--port", str(port),
        "--max-model-len", str(args.max_prompt_len + args.max_tokens + 1),
        "--log-level", "warning",
    ]  # fmt: skip
    if args.max_num_batched_tokens:
        command += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    with log_path.open("wb") as server_log:
        process = subprocess.Popen(command, stdout=server_log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + SERVER_STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited early; see {log_path}")
        try:
            if httpx.get(f"http://{LOOPBACK}:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"the server did not start in {SERVER_STARTUP_TIMEOUT_S} s; see {log_path}")


def stop_server(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# ---------------------------------------------------------------------------- the clients


@dataclass
class RequestTiming:
    ttft_s: float
    itl_s: list[float] = field(default_factory=list)  # one per token after the first
    num_output_tokens: int = 0


async def one_request(http: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> RequestTiming:
    body = {
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "stream": True, "logprobs": 0,
    }  # fmt: skip
    start_s = time.perf_counter()
    last_s = start_s
    timing: RequestTiming | None = None
    async with http.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now_s = time.perf_counter()
            choice = json.loads(line[6:])["choices"][0]
            num_tokens = len((choice.get("logprobs") or {}).get("tokens") or [])
            if num_tokens == 0:
                continue
            if timing is None:
                timing = RequestTiming(ttft_s=now_s - start_s)
                # Tokens that arrive together share the gap since the previous chunk.
                timing.itl_s += [0.0] * (num_tokens - 1)
            else:
                timing.itl_s += [(now_s - last_s) / num_tokens] * num_tokens
            timing.num_output_tokens += num_tokens
            last_s = now_s
    assert timing is not None, "a request streamed no tokens"
    return timing


async def run_level(
    base_url: str, prompts: list[list[int]], concurrency: int, max_tokens: int
) -> dict[str, Any]:
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    timings: list[RequestTiming] = []

    async def client(http: httpx.AsyncClient) -> None:
        while not queue.empty():
            timings.append(await one_request(http, queue.get_nowait(), max_tokens))

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=None, limits=limits) as http:
        start_s = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        wall_s = time.perf_counter() - start_s
    ttfts = [t.ttft_s for t in timings]
    itls = [gap for t in timings for gap in t.itl_s]
    num_output_tokens = sum(t.num_output_tokens for t in timings)
    return {
        "concurrency": concurrency,
        "num_requests": len(timings),
        "wall_s": wall_s,
        "requests_per_s": len(timings) / wall_s,
        "output_tokens_per_s": num_output_tokens / wall_s,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "itl_p50_s": percentile(itls, 50),
        "itl_p99_s": percentile(itls, 99),
    }


def percentile(values: list[float], pct: float) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[int(pct) - 1]


def markdown_table(levels: list[dict[str, Any]]) -> str:
    columns = ["clients", "requests/s", "output tok/s", "TTFT p50 s", "TTFT p99 s"]
    columns += ["ITL p50 ms", "ITL p99 ms"]
    lines = ["| " + " | ".join(columns) + " |", "|---:" * len(columns) + "|"]
    for level in levels:
        lines.append(
            f"| {level['concurrency']} | {level['requests_per_s']:.2f} "
            f"| {level['output_tokens_per_s']:.1f} | {level['ttft_p50_s']:.2f} "
            f"| {level['ttft_p99_s']:.2f} | {level['itl_p50_s'] * 1e3:.0f} "
            f"| {level['itl_p99_s'] * 1e3:.0f} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir = harness.ensure_qwen2_5_0_5b_shapes_checkpoint(args.model_dir, "s1")
    vocab_size = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    # Fresh prompts for every level: the server's prefix cache would otherwise serve a later
    # level's prompts from an earlier level's pages and flatter its latencies.
    prompts_per_level = [
        make_prompts(
            args.num_requests,
            args.min_prompt_len,
            args.max_prompt_len,
            vocab_size,
            seed=PROMPT_SEED + level,
        )
        for level in range(len(args.concurrency))
    ]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    log_path = args.output.with_suffix(".server.log")
    port = free_port()
    log(f"starting vacpack serve on port {port} (log: {log_path})")
    server = start_server(args, port, log_path)
    try:
        levels = []
        for concurrency, prompts in zip(args.concurrency, prompts_per_level, strict=True):
            log(f"{concurrency} concurrent clients, {len(prompts)} requests")
            level = asyncio.run(
                run_level(f"http://{LOOPBACK}:{port}", prompts, concurrency, args.max_tokens)
            )
            levels.append(level)
    finally:
        stop_server(server)
    results = {
        "workload": {
            "name": "S1",
            "model_dir": str(model_dir),
            "dtype": args.dtype,
            "num_requests": args.num_requests,
            "min_prompt_len": args.min_prompt_len,
            "max_prompt_len": args.max_prompt_len,
            "num_prompt_tokens_per_level": [sum(map(len, p)) for p in prompts_per_level],
            "max_tokens": args.max_tokens,
            "greedy": True,
            "ignore_eos": True,
        },
        "machine": machine_description(),
        "levels": levels,
        "transformers_serve": "not run: it needs accelerate, which is not installed here",
    }
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    log(f"wrote {args.output}")
    print(markdown_table(levels))
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=harness.QWEN2_5_0_5B_SHAPES_DIR)
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
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT_PATH)
    args = parser.parse_args(argv)
    if not 1 <= args.min_prompt_len <= args.max_prompt_len:
        parser.error("need 1 <= --min-prompt-len <= --max-prompt-len")
    return args


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
