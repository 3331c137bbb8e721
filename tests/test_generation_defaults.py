"""The model's recommended sampling (generation_config.json) as the default of every field a
request leaves out, as vLLM's `--generation-config auto`: through LLM, a batch file and the
server; `vllm` ignores it; a field given always wins."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from batch_lines import answer_lines
from server_process import ServerProcess, running_server

from vacpack import LLM, SamplingParams
from vacpack.generation_defaults import sampling_defaults
from vacpack.tokenizer import GENERATION_CONFIG_FILENAME

# top_k 1 makes sampling greedy whatever the temperature: a request that takes these defaults
# gives the greedy tokens, one that does not samples at temperature 1 from a random model.
RECOMMENDED = {"do_sample": True, "temperature": 0.7, "top_k": 1, "max_new_tokens": 5}
PROMPTS = ["the quick brown fox", "once upon a time", "hello there", "numbers 1 2 3"]


def _with_generation_config(source: Path, destination: Path, config: dict[str, Any]) -> Path:
    shutil.copytree(source, destination)
    path = destination / GENERATION_CONFIG_FILENAME
    written = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**written, **config}))
    return destination


@pytest.fixture(scope="module")
def recommending_checkpoint(tiny_checkpoint, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("recommends")
    return _with_generation_config(tiny_checkpoint("qwen2"), root / "qwen2", RECOMMENDED)


@pytest.fixture(scope="module")
def llm(recommending_checkpoint: Path) -> LLM:
    return LLM(str(recommending_checkpoint), dtype="float32", max_model_len=256)


def _greedy_texts(llm: LLM, max_tokens: int) -> list[str]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return [output.outputs[0].text for output in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_the_fields_read_and_where_from(recommending_checkpoint: Path, tmp_path: Path) -> None:
    expected = {"temperature": 0.7, "top_k": 1, "max_tokens": 5}
    assert sampling_defaults("auto", recommending_checkpoint) == expected
    assert sampling_defaults("vllm", recommending_checkpoint) == {}
    assert sampling_defaults(str(recommending_checkpoint), tmp_path) == expected
    assert sampling_defaults("auto", tmp_path) == {}  # a model without the file
    with pytest.raises(ValueError, match="does not exist; give auto, vllm, or a folder"):
        sampling_defaults(str(tmp_path), recommending_checkpoint)
    (tmp_path / GENERATION_CONFIG_FILENAME).write_text("[1, 2]")
    with pytest.raises(ValueError, match="is not a JSON object"):
        sampling_defaults(str(tmp_path), recommending_checkpoint)


def test_llm_generate_without_params_takes_the_models_sampling(llm: LLM) -> None:
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.7, 1, 5)
    outputs = llm.generate(PROMPTS, use_tqdm=False)
    assert [output.outputs[0].text for output in outputs] == _greedy_texts(llm, 5)


def test_vllm_ignores_the_models_sampling(recommending_checkpoint: Path) -> None:
    llm = LLM(
        str(recommending_checkpoint),
        dtype="float32",
        max_model_len=256,
        generation_config="vllm",
    )
    assert llm.get_default_sampling_params() == SamplingParams()


def test_a_bad_recommendation_is_refused_at_load(tiny_checkpoint, tmp_path: Path) -> None:
    broken = _with_generation_config(tiny_checkpoint("qwen2"), tmp_path / "m", {"top_p": 7})
    with pytest.raises(ValueError, match=r"recommended sampling \(auto\).*top_p"):
        LLM(str(broken), dtype="float32", max_model_len=256)


def test_batch_lines_take_the_models_sampling_for_fields_they_leave_out(
    llm: LLM, tmp_path: Path
) -> None:
    lines = [
        {"custom_id": f"p{index}", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": prompt, "max_tokens": 5}}
        for index, prompt in enumerate(PROMPTS)
    ]  # fmt: skip
    # A chat line without max_tokens takes the model's max_new_tokens.
    chat = {"messages": [{"role": "user", "content": "hi"}], "seed": 3}
    lines.append({"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
                  "body": chat})  # fmt: skip
    responses = answer_lines(llm, lines, tmp_path)
    bodies = {custom_id: response["body"] for custom_id, response in responses.items()}
    texts = [bodies[f"p{index}"]["choices"][0]["text"] for index in range(len(PROMPTS))]
    assert texts == _greedy_texts(llm, 5)
    assert bodies["chat"]["usage"]["completion_tokens"] <= 5


@pytest.fixture(scope="module")
def server(recommending_checkpoint: Path) -> Iterator[ServerProcess]:
    with running_server(recommending_checkpoint, "--max-model-len", "256") as process:
        yield process


def _completion_texts(server: ServerProcess, **fields: Any) -> list[str]:
    body = {"prompt": PROMPTS, "max_tokens": 5, **fields}
    response = httpx.post(f"{server.api_url}/completions", json=body, timeout=60.0)
    assert response.status_code == 200, response.text
    return [choice["text"] for choice in response.json()["choices"]]


def test_server_requests_take_the_models_sampling_and_given_fields_win(
    llm: LLM, server: ServerProcess
) -> None:
    greedy = _greedy_texts(llm, 5)
    for seed in (1, 2):
        assert _completion_texts(server, seed=seed) == greedy
    # top_k given: the request samples at the model's temperature from the whole vocabulary.
    sampled = [_completion_texts(server, seed=seed, top_k=0) for seed in (1, 2, 3)]
    assert any(texts != greedy for texts in sampled)
