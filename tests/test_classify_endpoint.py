"""/classify (vLLM's endpoint, and /v1/classify) over real HTTP and as run-batch lines: label
probabilities as transformers computes them, a softmax over exclusive labels and each label's
sigmoid for one label or multi-label classification, as its text-classification pipeline."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from server_process import ServerProcess, running_server
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from vacpack import LLM
from vacpack.batch.options import BatchOptions
from vacpack.batch.runner import run_batch
from vacpack.testing.tiny_encoders import build_tiny_bert
from vacpack.testing.tiny_models import build_tiny_classifier_checkpoint

TEXTS = ["the river runs to the sea", "bread, flour and salt", "numbers 12345"]


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_classifier_checkpoint("qwen2", tmp_path_factory.mktemp("cls") / "m")


@pytest.fixture(scope="module")
def server(classifier_dir: Path) -> Iterator[ServerProcess]:
    with running_server(classifier_dir, "--served-model-name", "clf") as process:
        yield process


def _transformers_probs(model_dir: Path, texts: list[str], independent: bool) -> torch.Tensor:
    reference = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = []
    for text in texts:  # one at a time: no padding to get right
        with torch.no_grad():
            logits = reference(torch.tensor([tokenizer.encode(text)])).logits[0]
        rows.append(torch.sigmoid(logits) if independent else torch.softmax(logits, -1))
    return torch.stack(rows)


def _post(server: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=60)


def test_classify_answers_with_the_models_label_probabilities(
    server: ServerProcess, classifier_dir: Path
) -> None:
    expected = _transformers_probs(classifier_dir, TEXTS, independent=False)
    for path in ("/classify", "/v1/classify"):
        response = _post(server, path, {"model": "clf", "input": TEXTS})
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["id"].startswith("classify-") and body["object"] == "list"
        assert body["model"] == "clf" and body["usage"]["prompt_tokens"] > 0
        for index, item in enumerate(body["data"]):
            assert item["index"] == index and item["num_classes"] == 3
            assert torch.allclose(torch.tensor(item["probs"]), expected[index], atol=1e-5)
            assert item["label"] == f"label_{int(expected[index].argmax())}"
    one = _post(server, "/classify", {"input": TEXTS[0]}).json()["data"]
    assert len(one) == 1 and one[0]["probs"] == pytest.approx(expected[0].tolist(), abs=1e-5)


def test_bad_classify_requests_get_a_400_naming_the_field(server: ServerProcess) -> None:
    for body, param in (({"input": []}, "input"), ({"input": ["ok", ""]}, "input")):
        response = _post(server, "/classify", body)
        assert response.status_code == 400 and response.json()["error"]["param"] == param
    response = _post(server, "/classify", {"model": "other", "input": "x"})
    assert response.status_code == 404


def test_truncate_prompt_tokens_classifies_each_inputs_first_tokens(
    server: ServerProcess, classifier_dir: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(classifier_dir)
    first_tokens = [tokenizer.decode(tokenizer.encode(text)[:2]) for text in TEXTS]
    expected = _transformers_probs(classifier_dir, first_tokens, independent=False)
    response = _post(server, "/classify", {"input": TEXTS, "truncate_prompt_tokens": 2})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["usage"]["prompt_tokens"] == 2 * len(TEXTS)
    probs = torch.tensor([item["probs"] for item in body["data"]])
    assert torch.allclose(probs, expected, atol=1e-5)
    for value in (0, -3, 10**6):
        refused = _post(server, "/v1/classify", {"input": TEXTS, "truncate_prompt_tokens": value})
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == "truncate_prompt_tokens" and "(max_model_len)" in error["message"]


@pytest.mark.parametrize("kind", ["one label", "multi-label"])
def test_independent_labels_get_each_its_sigmoid(kind: str, tmp_path: Path) -> None:
    if kind == "one label":
        model_dir = build_tiny_bert(tmp_path / "m", num_labels=1)
    else:
        model_dir = build_tiny_classifier_checkpoint(
            "qwen2", tmp_path / "m", problem_type="multi_label_classification"
        )
    llm = LLM(str(model_dir), dtype="float32", max_num_batched_tokens=256)
    probs = torch.tensor([o.outputs.probs for o in llm.classify(TEXTS, use_tqdm=False)])
    expected = _transformers_probs(model_dir, TEXTS, independent=True)
    assert torch.allclose(probs, expected, atol=1e-5)


def test_run_batch_answers_classify_lines(
    classifier_dir: Path, tiny_checkpoint, tmp_path: Path
) -> None:
    def run(llm: LLM, lines: list[tuple[str, str, Any]]) -> dict[str, dict[str, Any]]:
        records = [
            json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})
            for custom_id, url, body in lines
        ]
        input_path = tmp_path / f"{len(list(tmp_path.iterdir()))}.jsonl"
        input_path.write_text("".join(record + "\n" for record in records))
        options = BatchOptions(input_path, input_path.with_suffix(".out"), show_progress=False)
        run_batch(llm, options)
        answered = [json.loads(line) for line in options.output_path.read_text().splitlines()]
        return {record["custom_id"]: record["response"] for record in answered}

    classifier = LLM(str(classifier_dir), dtype="float32", max_num_batched_tokens=256)
    expected = [o.outputs.probs for o in classifier.classify(TEXTS, use_tqdm=False)]
    responses = run(
        classifier,
        [
            ("all", "/v1/classify", {"input": TEXTS}),
            ("alias", "/classify", {"input": TEXTS[1]}),
            ("empty", "/v1/classify", {"input": [""]}),
        ],
    )
    assert {key: r["status_code"] for key, r in responses.items()} == {
        "all": 200, "alias": 200, "empty": 400,
    }  # fmt: skip
    probs = [item["probs"] for item in responses["all"]["body"]["data"]]
    assert torch.allclose(torch.tensor(probs), torch.tensor(expected), atol=1e-6)
    assert responses["alias"]["body"]["data"][0]["probs"] == pytest.approx(expected[1], abs=1e-6)
    # A model without a classification head is told so.
    generator = LLM(str(tiny_checkpoint("qwen2")), dtype="float32", max_model_len=128)
    refused = run(generator, [("gen", "/v1/classify", {"input": "x"})])["gen"]
    assert refused["status_code"] == 400
    assert "has no classification head" in refused["body"]["error"]["message"]
