"""/v1/score, /v1/rerank, /tokenize, /detokenize and /v1/embeddings with dimensions, over real
HTTP against `vacpack serve`, and the same requests as lines of a `run-batch` file."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from sentence_transformers import CrossEncoder, SentenceTransformer
from server_process import ServerProcess, running_server

from vacpack import LLM
from vacpack.batch.options import BatchOptions
from vacpack.batch.runner import run_batch
from vacpack.testing.tiny_encoders import build_tiny_bert, build_tiny_decoder_embedding

API_KEY = "test-key"
QUERY = "where does the river run"
DOCUMENTS = [
    "the river runs past the old mill and into the sea",
    "a recipe for bread with flour, water and salt",
    "numbers 12345 and symbols",
    "the quick brown fox jumps over the lazy dog",
]


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_bert(tmp_path_factory.mktemp("reranker"), num_labels=1)


@pytest.fixture(scope="module")
def embedder_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_decoder_embedding(tmp_path_factory.mktemp("embedder"))


@pytest.fixture(scope="module")
def reranker_server(reranker_dir: Path) -> Iterator[ServerProcess]:
    args = ("--served-model-name", "reranker", "--api-key", API_KEY)
    with running_server(reranker_dir, *args) as process:
        yield process


@pytest.fixture(scope="module")
def embedder_server(embedder_dir: Path) -> Iterator[ServerProcess]:
    with running_server(embedder_dir, "--served-model-name", "embedder") as process:
        yield process


def _post(server: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    return httpx.post(f"{server.base_url}{path}", json=body, headers=headers, timeout=60)


def _error(response: httpx.Response, status_code: int, param: str | None, text: str) -> None:
    assert response.status_code == status_code, response.text
    error = response.json()["error"]
    assert error["param"] == param and text in error["message"], error


def test_score_and_rerank_answer_as_the_cross_encoder_scores(
    reranker_server: ServerProcess, reranker_dir: Path
) -> None:
    expected = CrossEncoder(str(reranker_dir), device="cpu").predict(
        [(QUERY, d) for d in DOCUMENTS]
    )
    for path in ("/v1/score", "/score"):
        body = _post(reranker_server, path, {"text_1": QUERY, "text_2": DOCUMENTS}).json()
        assert body["object"] == "list" and body["model"] == "reranker"
        assert body["id"].startswith("score-")
        assert [item["index"] for item in body["data"]] == list(range(len(DOCUMENTS)))
        scores = [item["score"] for item in body["data"]]
        np.testing.assert_allclose(scores, expected, atol=1e-4)
        assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    # N:N under vLLM's newer names.
    pairwise = _post(
        reranker_server, "/v1/score", {"queries": [QUERY] * 2, "documents": DOCUMENTS[:2]}
    ).json()
    np.testing.assert_allclose([d["score"] for d in pairwise["data"]], expected[:2], atol=1e-4)

    order = list(np.argsort(-expected))
    for path in ("/v1/rerank", "/rerank"):
        body = _post(
            reranker_server, path, {"query": QUERY, "documents": DOCUMENTS, "top_n": 3}
        ).json()
        assert [result["index"] for result in body["results"]] == order[:3]
        for result in body["results"]:
            assert result["document"] == {"text": DOCUMENTS[result["index"]]}
            assert result["relevance_score"] == pytest.approx(expected[result["index"]], abs=1e-4)
        assert body["id"].startswith("rerank-") and body["usage"]["total_tokens"] > 0
    everything = _post(
        reranker_server,
        "/rerank",
        {"query": QUERY, "documents": DOCUMENTS, "return_documents": False},
    ).json()["results"]
    assert len(everything) == len(DOCUMENTS) and all("document" not in r for r in everything)


def test_bad_score_requests_get_openai_style_errors(reranker_server: ServerProcess) -> None:
    _error(
        _post(reranker_server, "/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}),
        400, "text_2", "1:1, 1:N or N:N",
    )  # fmt: skip
    _error(
        _post(reranker_server, "/v1/rerank", {"query": QUERY, "documents": ["fine", " "]}),
        400, "documents", "documents 1 is empty",
    )  # fmt: skip
    _error(_post(reranker_server, "/v1/score", {"text_1": "a"}), 400, "text_2", "exactly one pair")
    _error(
        _post(reranker_server, "/v1/rerank", {"query": 3, "documents": ["a"]}),
        400, "query", "query",
    )  # fmt: skip
    _error(
        _post(reranker_server, "/v1/score", {"model": "other", "text_1": "a", "text_2": "b"}),
        404, "model", "does not exist",
    )  # fmt: skip
    _error(
        _post(reranker_server, "/v1/embeddings", {"input": "hello"}),
        400, "model", "is a classifier",
    )  # fmt: skip
    unauthorized = httpx.post(f"{reranker_server.base_url}/rerank", json={"query": "a"})
    assert unauthorized.status_code == 401
    # The server still answers after every refusal.
    assert _post(reranker_server, "/score", {"text_1": "a", "text_2": "b"}).status_code == 200


def test_tokenize_and_detokenize(reranker_server: ServerProcess, reranker_dir: Path) -> None:
    body = _post(
        reranker_server, "/tokenize", {"prompt": "hello world", "return_token_strs": True}
    ).json()
    assert body["tokens"] == [101, 7592, 2088, 102]  # [CLS] hello world [SEP]
    assert body["token_strs"] == ["[CLS]", "hello", "world", "[SEP]"]
    assert body["count"] == 4 and body["max_model_len"] == 512
    bare = _post(
        reranker_server, "/tokenize", {"prompt": "hello world", "add_special_tokens": False}
    )
    assert bare.json()["tokens"] == [7592, 2088] and bare.json()["token_strs"] is None
    text = _post(reranker_server, "/detokenize", {"tokens": [7592, 2088]}).json()
    assert text == {"prompt": "hello world"}
    _error(
        _post(reranker_server, "/detokenize", {"tokens": [7592, 10**6]}),
        400, "tokens", "not a token id",
    )  # fmt: skip
    _error(_post(reranker_server, "/tokenize", {}), 400, "prompt", "prompt or messages")


def test_a_decoder_embedding_model_serves_embeddings_scores_and_chat_tokens(
    embedder_server: ServerProcess, embedder_dir: Path
) -> None:
    reference = SentenceTransformer(str(embedder_dir), device="cpu")
    with openai.OpenAI(base_url=embedder_server.api_url, api_key="-", max_retries=0) as api:
        full = api.embeddings.create(model="embedder", input=DOCUMENTS)
        cut = api.embeddings.create(model="embedder", input=DOCUMENTS, dimensions=16)
        with pytest.raises(openai.BadRequestError, match="embedding size 64"):
            api.embeddings.create(model="embedder", input="hi", dimensions=65)
        with pytest.raises(openai.BadRequestError, match="does not generate text"):
            api.completions.create(model="embedder", prompt="hi", max_tokens=2)
    vectors = np.array([item.embedding for item in full.data])
    expected = reference.encode(DOCUMENTS)
    np.testing.assert_allclose(vectors, expected, atol=1e-4)
    cut_vectors = np.array([item.embedding for item in cut.data])
    assert cut_vectors.shape == (len(DOCUMENTS), 16)
    truncated = expected[:, :16] / np.linalg.norm(expected[:, :16], axis=1, keepdims=True)
    np.testing.assert_allclose(cut_vectors, truncated, atol=1e-4)

    # An embedding model scores by cosine similarity.
    scores = httpx.post(
        f"{embedder_server.base_url}/v1/score", json={"text_1": QUERY, "text_2": DOCUMENTS}
    ).json()["data"]
    query_vector = reference.encode([QUERY])[0]
    np.testing.assert_allclose([s["score"] for s in scores], expected @ query_vector, atol=1e-4)

    messages = [{"role": "user", "content": "hello"}]
    tokens = httpx.post(f"{embedder_server.base_url}/tokenize", json={"messages": messages})
    rendered = httpx.post(
        f"{embedder_server.base_url}/detokenize", json={"tokens": tokens.json()["tokens"]}
    ).json()["prompt"]
    assert rendered == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"


def test_truncate_prompt_tokens_cuts_each_pair_as_cross_encoder_max_length(
    reranker_server: ServerProcess, reranker_dir: Path
) -> None:
    """vLLM's field: each pair keeps its first k tokens, both texts' separators included."""
    k = 9
    pairs = [(QUERY, d) for d in DOCUMENTS]
    expected = CrossEncoder(str(reranker_dir), device="cpu", max_length=k).predict(pairs)
    body = {"text_1": QUERY, "text_2": DOCUMENTS, "truncate_prompt_tokens": k}
    scored = _post(reranker_server, "/v1/score", body).json()
    np.testing.assert_allclose([item["score"] for item in scored["data"]], expected, atol=1e-4)
    assert scored["usage"]["prompt_tokens"] == k * len(DOCUMENTS)  # every pair is longer
    ranking = {"query": QUERY, "documents": DOCUMENTS}
    ranked = _post(reranker_server, "/rerank", {**ranking, "truncate_prompt_tokens": k})
    ranked = ranked.json()["results"]
    assert [result["index"] for result in ranked] == list(np.argsort(-expected))
    scores = [result["relevance_score"] for result in sorted(ranked, key=lambda r: r["index"])]
    np.testing.assert_allclose(scores, expected, atol=1e-4)

    for path, value, text in (
        ("/v1/score", 0, "in [1, 512] (max_model_len), got 0"),
        ("/v1/score", 513, "got 513"),
        ("/v1/rerank", -2, "got -2"),
        # [CLS] q [SEP] d [SEP]: fewer than 5 tokens would drop a whole text.
        ("/rerank", 4, "in [5, 512] for this model, got 4"),
    ):
        inputs = {"text_1": QUERY, "text_2": DOCUMENTS} if path.endswith("score") else ranking
        body = {**inputs, "truncate_prompt_tokens": value}
        _error(_post(reranker_server, path, body), 400, "truncate_prompt_tokens", text)
    as_text = {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": "5"}
    _error(
        _post(reranker_server, "/score", as_text), 400, "truncate_prompt_tokens", "valid integer"
    )


def test_truncate_prompt_tokens_cuts_embeddings_to_their_first_tokens(
    embedder_server: ServerProcess, embedder_dir: Path
) -> None:
    reference = SentenceTransformer(str(embedder_dir), device="cpu")
    reference.max_seq_length = 3
    with openai.OpenAI(base_url=embedder_server.api_url, api_key="-", max_retries=0) as api:
        cut = api.embeddings.create(
            model="embedder", input=DOCUMENTS, extra_body={"truncate_prompt_tokens": 3}
        )
        whole = api.embeddings.create(
            model="embedder", input=DOCUMENTS, extra_body={"truncate_prompt_tokens": -1}
        )
        with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens") as refused:
            api.embeddings.create(
                model="embedder", input="hi", extra_body={"truncate_prompt_tokens": 0}
            )
    assert refused.value.body["param"] == "truncate_prompt_tokens"
    assert cut.usage.prompt_tokens == 3 * len(DOCUMENTS)
    vectors = np.array([item.embedding for item in cut.data])
    np.testing.assert_allclose(vectors, reference.encode(DOCUMENTS), atol=1e-4)
    reference.max_seq_length = 512
    np.testing.assert_allclose(
        [item.embedding for item in whole.data], reference.encode(DOCUMENTS), atol=1e-4
    )


# ------------------------------------------------------------------ run-batch


def _line(custom_id: str, url: str, body: dict[str, Any]) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _run(llm: LLM, tmp_path: Path, lines: list[str]) -> dict[str, dict[str, Any]]:
    input_path = tmp_path / "in.jsonl"
    input_path.write_text("".join(line + "\n" for line in lines))
    options = BatchOptions(input_path, tmp_path / "out.jsonl", show_progress=False)
    run_batch(llm, options)
    records = [json.loads(line) for line in options.output_path.read_text().splitlines()]
    return {record["custom_id"]: record["response"] for record in records}


def test_run_batch_answers_score_and_rerank_lines(reranker_dir: Path, tmp_path: Path) -> None:
    llm = LLM(str(reranker_dir), dtype="float32", max_num_batched_tokens=256)
    expected = [o.outputs.score for o in llm.score(QUERY, DOCUMENTS, use_tqdm=False)]
    responses = _run(
        llm,
        tmp_path,
        [
            _line("score", "/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS}),
            _line("score-alias", "/score", {"queries": QUERY, "documents": DOCUMENTS[:1]}),
            _line("rerank", "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 2}),
            _line("rerank-alias", "/rerank", {"query": QUERY, "documents": DOCUMENTS[2:]}),
            _line("bad-shape", "/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}),
            _line("empty-doc", "/v1/rerank", {"query": QUERY, "documents": ["ok", ""]}),
            _line("embed", "/v1/embeddings", {"input": "hello"}),
            _line("chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
        ],
    )
    assert {key: r["status_code"] for key, r in responses.items()} == {
        "score": 200, "score-alias": 200, "rerank": 200, "rerank-alias": 200,
        "bad-shape": 400, "empty-doc": 400, "embed": 400, "chat": 400,
    }  # fmt: skip
    scores = [item["score"] for item in responses["score"]["body"]["data"]]
    np.testing.assert_allclose(scores, expected, atol=1e-6)
    assert responses["score-alias"]["body"]["data"][0]["score"] == pytest.approx(expected[0])
    ranked = [r["index"] for r in responses["rerank"]["body"]["results"]]
    assert ranked == list(np.argsort(-np.array(expected))[:2])
    alias_ranked = responses["rerank-alias"]["body"]["results"]
    assert sorted(r["index"] for r in alias_ranked) == [0, 1]
    assert responses["bad-shape"]["body"]["error"]["param"] == "text_2"
    assert "is a classifier" in responses["embed"]["body"]["error"]["message"]
    assert "does not generate text" in responses["chat"]["body"]["error"]["message"]


def test_run_batch_lines_cut_only_where_they_ask(reranker_dir: Path, tmp_path: Path) -> None:
    """Lines with and without truncate_prompt_tokens are buffered together: each gets its own."""
    llm = LLM(str(reranker_dir), dtype="float32", max_num_batched_tokens=256)
    whole = [o.outputs.score for o in llm.score(QUERY, DOCUMENTS, use_tqdm=False)]
    cut = [
        o.outputs.score
        for o in llm.score(QUERY, DOCUMENTS, truncate_prompt_tokens=9, use_tqdm=False)
    ]
    assert not np.allclose(whole, cut, atol=1e-4), "cutting should change the scores"
    pair = {"text_1": QUERY, "text_2": DOCUMENTS}
    responses = _run(
        llm,
        tmp_path,
        [
            _line("whole", "/v1/score", pair),
            _line("cut", "/v1/score", {**pair, "truncate_prompt_tokens": 9}),
            _line("too-few", "/v1/score", {**pair, "truncate_prompt_tokens": 4}),
        ],
    )
    for key, expected in (("whole", whole), ("cut", cut)):
        scores = [item["score"] for item in responses[key]["body"]["data"]]
        np.testing.assert_allclose(scores, expected, atol=1e-6)
    assert responses["too-few"]["status_code"] == 400
    assert responses["too-few"]["body"]["error"]["param"] == "truncate_prompt_tokens"


def test_run_batch_embeds_with_dimensions(embedder_dir: Path, tmp_path: Path) -> None:
    llm = LLM(str(embedder_dir), dtype="float32", max_num_batched_tokens=256)
    responses = _run(
        llm,
        tmp_path,
        [
            _line("full", "/v1/embeddings", {"input": DOCUMENTS}),
            _line("cut", "/v1/embeddings", {"input": DOCUMENTS, "dimensions": 8}),
            _line("too-wide", "/v1/embeddings", {"input": "hi", "dimensions": 100}),
            _line("score", "/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS}),
        ],
    )
    full = np.array([item["embedding"] for item in responses["full"]["body"]["data"]])
    cut = np.array([item["embedding"] for item in responses["cut"]["body"]["data"]])
    np.testing.assert_allclose(
        cut, full[:, :8] / np.linalg.norm(full[:, :8], axis=1, keepdims=True), atol=1e-5
    )
    assert responses["too-wide"]["status_code"] == 400
    assert responses["too-wide"]["body"]["error"]["param"] == "dimensions"
    assert responses["score"]["status_code"] == 200
