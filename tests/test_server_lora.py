"""LoRA adapters on the server (vLLM's --enable-lora --lora-modules): a request's `model` picks
an adapter, its tokens those of LLM.generate with the adapter; /v1/models lists the adapters;
pooling with an adapter's name, an unknown name and a bad adapter at start are refused."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from lora_adapters import make_adapter
from server_process import ServerProcess, running_server

from vacpack import LLM, SamplingParams
from vacpack.lora.request import LoRARequest

TARGETS = ["q_proj", "v_proj", "down_proj"]
PROMPTS = ["The weather today is", "A long time ago"]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def base_dir(tiny_checkpoint) -> Path:
    return tiny_checkpoint("qwen2")


@pytest.fixture(scope="module")
def adapter_dirs(base_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: make_adapter(base_dir, root / name, seed=seed, targets=TARGETS, r=8, lora_alpha=16)
        for seed, name in enumerate(["sql", "poet"])
    }


@pytest.fixture(scope="module")
def server(base_dir: Path, adapter_dirs: dict[str, Path]) -> Iterator[ServerProcess]:
    modules = [f"{name}={path}" for name, path in adapter_dirs.items()]
    with running_server(
        base_dir, "--dtype", "float32", "--served-model-name", "base",
        "--enable-lora", "--lora-modules", *modules,
    ) as process:  # fmt: skip
        yield process


def _completion(server: ServerProcess, model: str, prompt: str) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    return httpx.post(f"{server.api_url}/completions", json=body, timeout=60)


def test_a_request_s_model_picks_its_adapter(
    server: ServerProcess, base_dir: Path, adapter_dirs: dict[str, Path]
) -> None:
    llm = LLM(str(base_dir), dtype="float32", enable_lora=True)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    texts: dict[str, list[str]] = {}
    for model in ["base", "sql", "poet"]:
        path = adapter_dirs.get(model)
        adapter = None if path is None else LoRARequest(model, len(texts) + 1, str(path))
        expected = llm.generate(PROMPTS, params, use_tqdm=False, lora_request=adapter)
        got = [_completion(server, model, prompt).json() for prompt in PROMPTS]
        assert [g["choices"][0]["text"] for g in got] == [o.outputs[0].text for o in expected]
        assert all(g["model"] == model for g in got)
        texts[model] = [g["choices"][0]["text"] for g in got]
    assert texts["sql"] != texts["base"] and texts["poet"] != texts["sql"]


def test_models_lists_the_adapters_with_their_base(
    server: ServerProcess, adapter_dirs: dict[str, Path]
) -> None:
    cards = httpx.get(f"{server.api_url}/models").json()["data"]
    assert [card["id"] for card in cards] == ["base", "sql", "poet"]
    assert cards[1]["parent"] == "base" and cards[1]["root"] == str(adapter_dirs["sql"])
    assert httpx.get(f"{server.api_url}/models/poet").json()["parent"] == "base"


def test_unknown_names_and_pooling_with_an_adapter_are_refused(server: ServerProcess) -> None:
    missing = _completion(server, "nope", "hi")
    assert missing.status_code == 404
    assert "`base`, `sql`, `poet`" in missing.json()["error"]["message"]
    pooled = httpx.post(
        f"{server.api_url}/embeddings", json={"model": "sql", "input": "hi"}, timeout=60
    )
    assert pooled.status_code == 400 and "LoRA adapter" in pooled.json()["error"]["message"]


def test_a_bad_adapter_stops_the_start_with_its_reason(base_dir: Path, tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "vacpack", "serve", "--model", str(base_dir), "--enable-lora",
         "--lora-modules", f"broken={tmp_path / 'missing'}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode != 0
    assert "LoRA adapter 'broken'" in result.stderr and "missing" in result.stderr


@pytest.fixture(scope="module")
def updating_server(base_dir: Path) -> Iterator[ServerProcess]:
    with running_server(
        base_dir, "--dtype", "float32", "--served-model-name", "base",
        "--enable-lora", "--allow-runtime-lora-updating",
    ) as process:  # fmt: skip
        yield process


def test_adapters_load_and_unload_at_run_time(
    updating_server: ServerProcess, base_dir: Path, adapter_dirs: dict[str, Path]
) -> None:
    api = updating_server.api_url
    assert _completion(updating_server, "sql", "hi").status_code == 404
    body = {"lora_name": "sql", "lora_path": str(adapter_dirs["sql"])}
    loaded = httpx.post(f"{api}/load_lora_adapter", json=body, timeout=60)
    assert loaded.status_code == 200 and "added" in loaded.text
    llm = LLM(str(base_dir), dtype="float32", enable_lora=True)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    adapter = LoRARequest("sql", 1, str(adapter_dirs["sql"]))
    expected = llm.generate([PROMPTS[0]], params, use_tqdm=False, lora_request=adapter)
    got = _completion(updating_server, "sql", PROMPTS[0]).json()["choices"][0]["text"]
    assert got == expected[0].outputs[0].text
    assert [c["id"] for c in httpx.get(f"{api}/models").json()["data"]] == ["base", "sql"]
    again = httpx.post(f"{api}/load_lora_adapter", json=body, timeout=60)
    assert again.status_code == 400 and "served already" in again.json()["error"]["message"]
    broken = {"lora_name": "broken", "lora_path": str(base_dir / "missing")}
    refused = httpx.post(f"{api}/load_lora_adapter", json=broken, timeout=60)
    assert refused.status_code == 400 and "missing" in refused.json()["error"]["message"]
    unloaded = httpx.post(f"{api}/unload_lora_adapter", json={"lora_name": "sql"}, timeout=60)
    assert unloaded.status_code == 200 and "removed" in unloaded.text
    assert _completion(updating_server, "sql", "hi").status_code == 404
    gone = httpx.post(f"{api}/unload_lora_adapter", json={"lora_name": "sql"}, timeout=60)
    assert gone.status_code == 404
    # Loaded again under its old name: a new id, the same answers.
    assert httpx.post(f"{api}/load_lora_adapter", json=body, timeout=60).status_code == 200
    again_text = _completion(updating_server, "sql", PROMPTS[0]).json()["choices"][0]["text"]
    assert again_text == expected[0].outputs[0].text


def test_an_adapter_in_use_is_not_unloaded(
    updating_server: ServerProcess, adapter_dirs: dict[str, Path]
) -> None:
    api = updating_server.api_url
    body = {"lora_name": "poet", "lora_path": str(adapter_dirs["poet"])}
    assert httpx.post(f"{api}/load_lora_adapter", json=body, timeout=60).status_code == 200
    long_request = {"model": "poet", "prompt": "hi", "max_tokens": 400, "ignore_eos": True}
    streamed = {**long_request, "stream": True}
    with (
        httpx.Client(timeout=120) as client,
        client.stream("POST", f"{api}/completions", json=streamed),
    ):
        busy = client.post(f"{api}/unload_lora_adapter", json={"lora_name": "poet"})
    assert busy.status_code == 409 and "in use" in busy.json()["error"]["message"]


def test_the_runtime_endpoints_are_off_unless_asked_for(server: ServerProcess) -> None:
    body = {"lora_name": "x", "lora_path": "/nowhere"}
    assert httpx.post(f"{server.api_url}/load_lora_adapter", json=body).status_code == 404
