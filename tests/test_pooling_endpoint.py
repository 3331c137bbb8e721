"""/pooling (vLLM's endpoint, and /v1/pooling): LLM.encode's tasks over real HTTP and as
run-batch lines, each input's tensor as LLM.encode gives it, and the 400s."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from batch_lines import answer_lines
from server_process import ServerProcess, running_server

from vacpack import LLM, PoolingParams
from vacpack.testing.tiny_encoders import build_tiny_bert
from vacpack.testing.tiny_models import build_tiny_classifier_checkpoint

TEXTS = ["the river runs to the sea", "bread, flour and salt", "numbers 12345"]


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_bert(tmp_path_factory.mktemp("encoder"))


@pytest.fixture(scope="module")
def encoder(encoder_dir: Path) -> LLM:
    return LLM(str(encoder_dir), dtype="float32", max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def server(encoder_dir: Path) -> Iterator[ServerProcess]:
    with running_server(encoder_dir, "--served-model-name", "enc") as process:
        yield process


def _post(server: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=60)


def test_pooling_answers_each_inputs_token_vectors(server: ServerProcess, encoder: LLM) -> None:
    expected = encoder.encode(TEXTS, pooling_task="token_embed", use_tqdm=False)
    for path in ("/pooling", "/v1/pooling"):
        response = _post(server, path, {"model": "enc", "input": TEXTS})  # token_embed: default
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["id"].startswith("pool-") and body["object"] == "list"
        assert body["usage"]["prompt_tokens"] == sum(len(e.prompt_token_ids) for e in expected)
        for index, (item, output) in enumerate(zip(body["data"], expected, strict=True)):
            assert item["index"] == index and item["object"] == "pooling"
            assert torch.allclose(torch.tensor(item["data"]), output.outputs.data, atol=1e-5)


def test_pooling_tasks_options_and_base64(server: ServerProcess, encoder: LLM) -> None:
    body = {"input": TEXTS[0], "task": "embed", "encoding_format": "base64"}
    response = _post(server, "/pooling", body)
    assert response.status_code == 200, response.text
    packed = base64.b64decode(response.json()["data"][0]["data"])
    embedding = np.frombuffer(packed, dtype="<f4")
    expected = encoder.embed([TEXTS[0]], use_tqdm=False)[0].outputs.embedding
    assert np.allclose(embedding, expected, atol=1e-5)
    body = {"input": TEXTS, "use_activation": False, "dimensions": 8}
    raw = _post(server, "/pooling", body).json()["data"]
    params = PoolingParams(use_activation=False, dimensions=8)
    expected_raw = encoder.encode(TEXTS, params, pooling_task="token_embed", use_tqdm=False)
    for item, output in zip(raw, expected_raw, strict=True):
        assert torch.allclose(torch.tensor(item["data"]), output.outputs.data, atol=1e-5)
        assert output.outputs.data.shape[1] == 8


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"input": "x", "task": "token_classify"}, "task", "ForTokenClassification"),
        ({"input": "x", "task": "classify"}, "task", "does not classify"),
        ({"input": "x", "task": "reward"}, "task", "task must be one of token_embed"),
        ({"input": "x", "dimensions": 10**4}, "dimensions", "more than the model's embedding"),
        ({"input": []}, "input", "must not be an empty list"),
        ({"input": ["ok", ""]}, "input", "input 1 is empty"),
    ],
)
def test_bad_pooling_requests_get_a_400_naming_the_field(
    server: ServerProcess, body: dict[str, Any], param: str, message: str
) -> None:
    response = _post(server, "/pooling", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error


def test_run_batch_answers_pooling_lines_of_a_classifier(tmp_path: Path) -> None:
    model_dir = build_tiny_classifier_checkpoint("qwen2", tmp_path / "classifier")
    classifier = LLM(str(model_dir), dtype="float32", max_num_batched_tokens=256)
    lines = [
        ("default", {"input": TEXTS}),  # a classifier's default task: classify
        ("logits", {"input": TEXTS, "task": "classify", "use_activation": False}),
        ("tokens", {"input": TEXTS, "task": "token_embed"}),
    ]
    records = [
        {"custom_id": key, "method": "POST", "url": "/pooling", "body": body} for key, body in lines
    ]
    responses = answer_lines(classifier, records, tmp_path)
    assert {key: r["status_code"] for key, r in responses.items()} == {
        "default": 200, "logits": 200, "tokens": 400,
    }  # fmt: skip
    expected = [o.outputs.probs for o in classifier.classify(TEXTS, use_tqdm=False)]
    probs = [item["data"] for item in responses["default"]["body"]["data"]]
    assert torch.allclose(torch.tensor(probs), torch.tensor(expected), atol=1e-6)
    logits = torch.tensor([item["data"] for item in responses["logits"]["body"]["data"]])
    assert torch.allclose(logits.softmax(-1), torch.tensor(expected), atol=1e-6)
    assert "is a classifier" in responses["tokens"]["body"]["error"]["message"]
