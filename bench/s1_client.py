"""S1's clients: closed-loop clients streaming /v1/completions, the timing of each request, and
a level's numbers (requests/s, output tokens/s, TTFT, TPOT, ITL)."""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from s1_workload import ServerSpec


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
