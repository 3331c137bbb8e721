"""/metrics reports the prefix cache (lookups, hits, hit rate, evictions), preemptions, and
what was chosen by measurement at load."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch
from server_process import ServerProcess, metric_value, running_server

from vacpack.cpu_kernels import varlen_attention_supported
from vacpack.cpu_kernels.build import load_kernel_library
from vacpack.cpu_kernels.elementwise import elementwise_kernels_available
from vacpack.models.layer_ops_choice import DECODER_LAYER_OP_PHASES
from vacpack.models.linear_choice import eligible_linear_kernels

MAX_MODEL_LEN = 256
PAGE_SIZE_TOKENS = 16
TINY_HEAD_DIM = 16
# The tiny float32 model keeps 2 layers x (K + V) x 2 heads x 16 dims x 4 bytes per token.
KV_BYTES_PER_PAGE = 2 * 2 * 2 * TINY_HEAD_DIM * 4 * PAGE_SIZE_TOKENS
# 20 pages (320 tokens): one full-length sequence fits, four long ones running together do not.
NUM_KV_PAGES = 20


@pytest.fixture(scope="module")
def server(tiny_checkpoint) -> Iterator[ServerProcess]:
    with running_server(
        tiny_checkpoint("qwen2"),
        "--max-model-len", str(MAX_MODEL_LEN),
        "--block-size", str(PAGE_SIZE_TOKENS),
        "--kv-cache-memory-bytes", str(NUM_KV_PAGES * KV_BYTES_PER_PAGE),
        "--served-model-name", "tiny",
    ) as process:  # fmt: skip
        yield process


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60.0) as http:
        yield http


def _metrics(client: httpx.Client) -> dict[str, float]:
    text = client.get("/metrics").text
    assert metric_value(text, "vacpack:kv_cache_total_pages") == NUM_KV_PAGES
    names = [
        "prefix_cache_queries_total", "prefix_cache_hits_total", "prefix_cache_hit_rate",
        "prefix_cache_evictions_total", "num_preemptions_total",
    ]  # fmt: skip
    return {name: metric_value(text, f"vacpack:{name}") for name in names}


def _complete(client: httpx.Client, **fields: Any) -> dict[str, Any]:
    body = {"model": "tiny", "temperature": 0, "ignore_eos": True, **fields}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_repeated_prompt_is_a_prefix_cache_hit(client: httpx.Client) -> None:
    prompt_ids = [(7 * i) % 97 + 3 for i in range(100)]  # 6 full pages and a partial one
    before = _metrics(client)
    _complete(client, prompt=prompt_ids, max_tokens=2)
    _complete(client, prompt=prompt_ids, max_tokens=2)
    after = _metrics(client)

    queried = after["prefix_cache_queries_total"] - before["prefix_cache_queries_total"]
    hits = after["prefix_cache_hits_total"] - before["prefix_cache_hits_total"]
    assert queried == 2 * len(prompt_ids)
    assert hits == 6 * PAGE_SIZE_TOKENS  # the second request found every full page cached
    assert after["prefix_cache_hit_rate"] == pytest.approx(
        after["prefix_cache_hits_total"] / after["prefix_cache_queries_total"]
    )
    assert after["prefix_cache_hit_rate"] > 0


def test_a_tiny_kv_cache_preempts_and_evicts(client: httpx.Client) -> None:
    before = _metrics(client)
    # Four sequences admitted together, each growing to 40 + 200 tokens (15 pages): 60 pages
    # wanted, 20 there. They grow in step, so the pool runs dry long before any finishes.
    prompts = [[(13 * i + seed) % 89 + 3 for i in range(40)] for seed in range(4)]
    response = _complete(client, prompt=prompts, max_tokens=200)
    assert [c["finish_reason"] for c in response["choices"]] == ["length"] * 4
    after = _metrics(client)

    assert after["num_preemptions_total"] > before["num_preemptions_total"]
    # A preempted sequence's full pages stay cached; the survivors' new pages evict them.
    assert after["prefix_cache_evictions_total"] > before["prefix_cache_evictions_total"]
    text = client.get("/metrics").text
    assert metric_value(text, "vacpack:kv_cache_used_pages") == 0


def _label(line: str, name: str) -> str:
    return line.split(f'{name}="')[1].split('"')[0]


def _sdpa_options_timed(chosen: list[str]) -> set[str]:
    """torch_sdpa's options reported beside the backends' choices: measured with the backend
    wherever the backends were timed, but from a cached backend choice only where it is
    torch_sdpa (an earlier process of this session may have cached either: their timings are
    close on the tiny model). Its decode form is timed on decodes, its prefill kernel on both."""
    backends = {_label(line, "phase"): line for line in chosen if 'phase="attention_paged' in line}

    def sdpa_timed(phase: str) -> bool:
        line = backends[phase]
        return _label(line, "chosen") == "torch_sdpa" or _label(line, "source") != "cached"

    decode = sdpa_timed("attention_paged")
    prefill = decode or sdpa_timed("attention_paged_prefill")
    return {name for name, timed in (("sdpa_decode", decode), ("sdpa_prefill", prefill)) if timed}


def test_metrics_name_what_was_chosen_by_measurement(client: httpx.Client) -> None:
    text = client.get("/metrics").text
    chosen = [line for line in text.splitlines() if line.startswith("vacpack:measured_choice{")]
    phases = {line.split('phase="')[1].split('"')[0] for line in chosen}
    # Where the float32 C attention kernel builds, the backends for decodes and for prefill
    # steps; torch_sdpa's prefill and decode kernels, as prefills reach 256 tokens here (the
    # dtype is named and the context too short for the cascade's shortest prefix), wherever
    # torch_sdpa was timed; the layer ops where the fused float32 kernels build, and the
    # linears' kernel where the C one builds.
    cpu = torch.device("cpu")
    layer_ops = elementwise_kernels_available(cpu, torch.float32)
    two_backends = varlen_attention_supported(cpu, torch.float32, TINY_HEAD_DIM)
    backends = {"attention_paged", "attention_paged_prefill"} if two_backends else set()
    options = _sdpa_options_timed(chosen) if two_backends else {"sdpa_prefill", "sdpa_decode"}
    linears = {"cpu_linear"} if len(eligible_linear_kernels(cpu, torch.float32)) > 1 else set()
    assert (
        phases == options | backends | set(DECODER_LAYER_OP_PHASES if layer_ops else ()) | linears
    )
    assert all(line.endswith(" 1.0") and 'model_name="tiny"' in line for line in chosen)
    rounds = [
        line for line in text.splitlines() if line.startswith("vacpack:measured_choice_rounds{")
    ]
    assert {line.split('phase="')[1].split('"')[0] for line in rounds} == phases
    round_counts = [float(line.rsplit(" ", 1)[1]) for line in rounds]
    assert all(count == int(count) >= 0 for count in round_counts) and max(round_counts) >= 1
    timed = [
        line for line in text.splitlines() if line.startswith("vacpack:measured_choice_candidate")
    ]
    candidates = {line.split('candidate="')[1].split('"')[0] for line in timed}
    # torch_sdpa's decode forms, where timed: the portable C decode kernel competes wherever it
    # builds, in both forms (the tiny model groups query heads); the layer ops' two sets too.
    built = load_kernel_library("paged_decode", portable=True)
    kernel = {"kernel", "kernel_lanes"} if built else set()
    sdpa_names = {"sdpa", "blocked"} if "sdpa_prefill" in options else set()
    if "sdpa_decode" in options:
        sdpa_names |= {"sdpa", "matmuls"} | kernel
    fused = {"cpu_kernels", "torch"} if layer_ops else set()
    backend_names = {"cpu_kernels", "torch_sdpa"} if two_backends else set()
    linear_names = {"onednn", "c_gemm"} if linears else set()
    assert candidates == sdpa_names | fused | backend_names | linear_names
    assert all(float(line.rsplit(" ", 1)[1]) > 0 for line in timed)
