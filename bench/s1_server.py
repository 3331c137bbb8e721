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
import importlib.util
import itertools
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import harness
import httpx
import torch
from harness import (
    machine_description,
    machine_summary,
    markdown_cell,
    publish_results,
    save_bar_chart,
    timed_section,
)

SYSTEMS: tuple[str, ...] = ("vacpack", "transformers_serve")
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUTPUT_PATH = REPO_ROOT / "bench" / "results" / "s1_server_cpu.json"
DEFAULT_PLOT_PATH = REPO_ROOT / "bench" / "results" / "s1_server_cpu.png"
CHECKPOINT_CACHE_DIR = harness.QWEN2_5_0_5B_SHAPES_DIR.parent
PROMPT_SEED = 0
LOOPBACK = "127.0.0.1"
SERVER_STARTUP_TIMEOUT_S = 600.0
SERVER_STOP_TIMEOUT_S = 60.0
# vacpack's CPU step budget when none is given; transformers' continuous batching gets the same.
VACPACK_CPU_DEFAULT_BATCHED_TOKENS = 2048
# transformers' own default page size for continuous batching.
HF_CB_PAGE_SIZE_TOKENS = 256
# Modules `transformers serve` imports (transformers[serving]) before it can answer.
TRANSFORMERS_SERVE_MODULES = ("accelerate", "fastapi", "uvicorn", "pydantic", "openai", "rich")
LOG_TAIL_CHARS = 2000


def log(message: str) -> None:
    harness.log(message, "s1")


# ---------------------------------------------------------------------------- the checkpoint


def decodable_token_ids(model_dir: Path) -> list[int]:
    """Ids whose token decodes, alone, to text without a replacement character."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    special_ids = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    ids = []
    for token_id in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        if token_id in special_ids:
            continue
        text = tokenizer.decode([token_id])
        if text and "\ufffd" not in text:
            ids.append(token_id)
    return ids


def ensure_decodable_checkpoint(source_dir: Path) -> Path:
    """`source_dir` with the embedding and LM-head rows of undecodable ids zeroed (built once)."""
    target_dir = CHECKPOINT_CACHE_DIR / f"s1-{source_dir.name}-decodable"
    marker = target_dir / "s1_source.json"
    source = {"source_dir": str(source_dir.resolve())}
    if marker.exists() and json.loads(marker.read_text()) == source:
        return target_dir
    from safetensors import safe_open
    from safetensors.torch import save_file

    log(f"building {target_dir}: {source_dir} with undecodable ids' embedding rows zeroed")
    vocab_size = int(json.loads((source_dir / "config.json").read_text())["vocab_size"])
    keep = torch.zeros(vocab_size, dtype=torch.bool)
    keep[decodable_token_ids(source_dir)] = True
    partial_dir = target_dir.with_name(f"{target_dir.name}.partial-{os.getpid()}")
    partial_dir.mkdir(parents=True)
    for path in source_dir.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy2(path, partial_dir / path.name)
            continue
        with safe_open(path, framework="pt") as shard:
            metadata = shard.metadata()
            tensors = {name: shard.get_tensor(name) for name in shard.keys()}  # noqa: SIM118
        for tensor in tensors.values():
            if tensor.dim() == 2 and tensor.shape[0] == vocab_size:  # embed_tokens, lm_head
                tensor[~keep] = 0
        save_file(tensors, partial_dir / path.name, metadata=metadata)
    (partial_dir / marker.name).write_text(json.dumps(source))
    shutil.rmtree(target_dir, ignore_errors=True)
    partial_dir.rename(target_dir)
    return target_dir


# ---------------------------------------------------------------------------- the prompts


def make_prompts(
    model_dir: Path, num_prompts: int, min_prompt_len: int, max_prompt_len: int, seed: int
) -> list[str]:
    """Texts of random decodable tokens; re-encoded they are about their drawn length."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    token_ids = torch.tensor(decodable_token_ids(model_dir))
    generator = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(
        min_prompt_len, max_prompt_len + 1, (num_prompts,), generator=generator
    ).tolist()
    prompts = []
    for prompt_len in prompt_lens:
        drawn = token_ids[torch.randint(0, len(token_ids), (prompt_len,), generator=generator)]
        # Tokens joined into text merge into other tokens when encoded again: cut the
        # re-encoding to the drawn length, so the text is that long or close to it.
        text = tokenizer.decode(drawn.tolist())
        prompts.append(tokenizer.decode(tokenizer.encode(text).ids[:prompt_len]))
    return prompts


def num_prompt_tokens(model_dir: Path, prompts: list[str]) -> list[int]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return [len(encoding.ids) for encoding in tokenizer.encode_batch(prompts)]


# ---------------------------------------------------------------------------- the servers


@dataclass(frozen=True)
class ServerSpec:
    """How to start one system's server and what its request bodies add to the common ones."""

    name: str
    command: list[str]
    extra_body: dict[str, Any]
    settings: dict[str, Any]  # what the results record about how it ran


def vacpack_spec(
    args: argparse.Namespace, model_dir: Path, max_model_len: int, port: int
) -> ServerSpec:
    command = [
        sys.executable, "-m", "vacpack", "serve",
        "--model", str(model_dir), "--served-model-name", str(model_dir), "--dtype", args.dtype,
        "--host", LOOPBACK, "--port", str(port), "--max-model-len", str(max_model_len),
        "--log-level", "warning",
    ]  # fmt: skip
    if args.max_num_batched_tokens:
        command += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    return ServerSpec("vacpack", command, {"ignore_eos": True}, {"flags": command[4:]})


def transformers_serve_spec(
    args: argparse.Namespace, model_dir: Path, max_model_len: int, port: int
) -> ServerSpec:
    launch = "import sys; from transformers.cli.transformers import main; sys.exit(main())"
    flags = [
        "serve", str(model_dir), "--device", "cpu" if not torch.cuda.is_available() else "cuda",
        "--dtype", args.dtype, "--attn-implementation", "sdpa",
        "--host", LOOPBACK, "--port", str(port), "--log-level", "warning",
    ]  # fmt: skip
    if args.transformers_mode == "continuous-batching":
        # Pages for every client's request at full length at once, as vacpack has room for.
        pages_per_request = math.ceil(max_model_len / HF_CB_PAGE_SIZE_TOKENS)
        flags += [
            "--continuous-batching",
            "--cb-block-size", str(HF_CB_PAGE_SIZE_TOKENS),
            "--cb-num-blocks", str(pages_per_request * max(args.concurrency)),
            "--cb-max-batch-tokens",
            str(args.max_num_batched_tokens or VACPACK_CPU_DEFAULT_BATCHED_TOKENS),
        ]  # fmt: skip
    # eos_token_id -1 leaves the request's EOS set empty: every request runs to max_tokens.
    extra_body = {"generation_config": json.dumps({"eos_token_id": -1})}
    settings = {"mode": args.transformers_mode, "flags": flags}
    return ServerSpec(
        "transformers_serve", [sys.executable, "-c", launch, *flags], extra_body, settings
    )


def transformers_serve_missing() -> str | None:
    """Why `transformers serve` cannot run here, or None if nothing it imports is missing."""
    missing = [m for m in TRANSFORMERS_SERVE_MODULES if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    return (
        f"not run: transformers serve needs {', '.join(missing)}, not installed here "
        '(pip install -e ".[bench]" installs what it needs)'
    )


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


# ---------------------------------------------------------------------------- the clients


@dataclass
class RequestTiming:
    ttft_s: float  # to the first chunk with text
    e2e_s: float  # to the end of the stream
    chunk_gaps_s: list[float] = field(default_factory=list)  # between chunks with text
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0


async def one_request(http: httpx.AsyncClient, body: dict[str, Any]) -> RequestTiming:
    start_s = time.perf_counter()
    text_times_s: list[float] = []
    usage: dict[str, int] | None = None
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:500]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"error mid-stream: {chunk['error']}")
            if any(choice.get("text") for choice in chunk.get("choices") or ()):
                text_times_s.append(time.perf_counter())
            usage = chunk.get("usage") or usage
    end_s = time.perf_counter()
    if usage is None:
        raise RuntimeError("the stream carried no usage")
    first_s = text_times_s[0] if text_times_s else end_s
    return RequestTiming(
        ttft_s=first_s - start_s,
        e2e_s=end_s - start_s,
        chunk_gaps_s=[b - a for a, b in itertools.pairwise(text_times_s)],
        num_prompt_tokens=usage["prompt_tokens"],
        num_output_tokens=usage["completion_tokens"],
    )


def request_body(spec: ServerSpec, model_dir: Path, prompt: str, max_tokens: int) -> dict:
    return {
        "model": str(model_dir), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True}, **spec.extra_body,
    }  # fmt: skip


async def run_level(
    base_url: str, bodies: list[dict[str, Any]], concurrency: int
) -> list[RequestTiming]:
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    for body in bodies:
        queue.put_nowait(body)
    timings: list[RequestTiming] = []

    async def client(http: httpx.AsyncClient) -> None:
        while not queue.empty():
            timings.append(await one_request(http, queue.get_nowait()))

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=None, limits=limits) as http:
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
    return timings


def level_fields(
    concurrency: int, timings: list[RequestTiming], wall_s: float, max_tokens: int
) -> dict[str, Any]:
    num_output_tokens = sum(t.num_output_tokens for t in timings)
    # vLLM's TPOT: the mean time per output token after the first, one value per request.
    tpots = [
        (t.e2e_s - t.ttft_s) / (t.num_output_tokens - 1) for t in timings if t.num_output_tokens > 1
    ]
    ttfts = [t.ttft_s for t in timings]
    gaps = [gap for t in timings for gap in t.chunk_gaps_s]
    return {
        "concurrency": concurrency,
        "num_requests": len(timings),
        "num_prompt_tokens": sum(t.num_prompt_tokens for t in timings),
        "num_output_tokens": num_output_tokens,
        "num_requests_short_of_max_tokens": sum(t.num_output_tokens < max_tokens for t in timings),
        "wall_s": wall_s,
        "requests_per_s": len(timings) / wall_s,
        "output_tokens_per_s": num_output_tokens / wall_s,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "tpot_p50_s": percentile(tpots, 50),
        "tpot_p99_s": percentile(tpots, 99),
        "itl_p50_s": percentile(gaps, 50),
        "itl_p99_s": percentile(gaps, 99),
    }


def percentile(values: list[float], pct: float) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[int(pct) - 1]


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


# ---------------------------------------------------------------------------- the report


def speedups(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Per level: how many times vacpack's throughput, and how many times fewer its latencies."""
    systems = results["systems"]
    if any("levels" not in systems.get(name, {}) for name in SYSTEMS):
        return []
    rows = []
    for ours, theirs in zip(
        systems["vacpack"]["levels"], systems["transformers_serve"]["levels"], strict=True
    ):
        rows.append(
            {
                "concurrency": ours["concurrency"],
                "output_tokens_per_s": ours["output_tokens_per_s"] / theirs["output_tokens_per_s"],
                "requests_per_s": ours["requests_per_s"] / theirs["requests_per_s"],
                "ttft_p50": theirs["ttft_p50_s"] / ours["ttft_p50_s"],
                "tpot_p50": theirs["tpot_p50_s"] / ours["tpot_p50_s"],
            }
        )
    return rows


def markdown_table(results: dict[str, Any]) -> str:
    columns = ["clients", "server", "requests/s", "output tok/s", "TTFT p50 s", "TTFT p99 s"]
    columns += ["TPOT p50 ms", "TPOT p99 ms", "ITL p99 ms", "vacpack speed-up (tok/s)"]
    lines = ["| " + " | ".join(columns) + " |", "|---:|---|" + "---:|" * (len(columns) - 2)]
    speedup_by_level = {row["concurrency"]: row for row in results["speedups"]}
    levels, failures = [], []
    for name, system in results["systems"].items():
        if "error" in system:
            failures.append(f"| — | {name} | {markdown_cell(system['error'])} |" + " |" * 7)
            continue
        levels += [(level["concurrency"], name, level) for level in system["levels"]]
    for concurrency, name, level in sorted(levels, key=lambda item: item[0]):
        speedup = speedup_by_level.get(concurrency)
        ratio = (
            f"{speedup['output_tokens_per_s']:.2f}x"
            if speedup and name == "transformers_serve"
            else "—"
        )
        lines.append(
            f"| {concurrency} | {name} | {level['requests_per_s']:.2f} "
            f"| {level['output_tokens_per_s']:.1f} | {level['ttft_p50_s']:.2f} "
            f"| {level['ttft_p99_s']:.2f} | {level['tpot_p50_s'] * 1e3:.0f} "
            f"| {level['tpot_p99_s'] * 1e3:.0f} | {level['itl_p99_s'] * 1e3:.0f} | {ratio} |"
        )
    return "\n".join(lines + failures)


def save_plot(results: dict[str, Any], plot_path: Path) -> None:
    values = {
        f"{name}\n{level['concurrency']} clients": level["output_tokens_per_s"]
        for name, system in results["systems"].items()
        for level in system.get("levels", ())
    }
    workload = results["workload"]
    save_bar_chart(
        values,
        plot_path,
        ylabel="output tokens/s",
        title=(
            f"S1: streaming /v1/completions, {workload['num_requests']} requests per level, "
            f"{workload['max_tokens']} output tokens\n"
            f"{machine_summary(results['machine'])}"
        ),
    )


# ---------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    source_dir = harness.ensure_qwen2_5_0_5b_shapes_checkpoint(args.model_dir, "s1")
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
    parser.add_argument("--plot", type=Path, default=DEFAULT_PLOT_PATH)
    args = parser.parse_args(argv)
    if not 1 <= args.min_prompt_len <= args.max_prompt_len:
        parser.error("need 1 <= --min-prompt-len <= --max-prompt-len")
    if unknown := set(args.systems) - set(SYSTEMS):
        parser.error(f"unknown systems {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    return args


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
