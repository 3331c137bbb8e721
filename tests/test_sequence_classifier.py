"""Llama-family sequence classifiers, packed, against transformers one sequence at a time."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from vacpack.models.labels import id2label_from_hf, num_labels_from_hf
from vacpack.models.llama_classifier import LlamaForSequenceClassification
from vacpack.testing.packed_forward import load_for_test, packed_forward
from vacpack.testing.tiny_models import build_tiny_classifier_checkpoint

FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]
NUM_LABELS = 3
SEQUENCE_LENGTHS = [1, 2, 7, 16, 33, 90, 5]


def _sequences(vocab_size: int, seed: int = 0) -> list[list[int]]:
    # Token 0 is the tiny tokenizer's pad token, which transformers would skip when it picks the
    # last token of a sequence; leaving it out makes "last token" mean the same on both sides.
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randint(1, vocab_size, (n,), generator=generator).tolist() for n in SEQUENCE_LENGTHS
    ]


@pytest.fixture(scope="module", params=FAMILIES)
def classifier_dir(request: pytest.FixtureRequest, tmp_path_factory) -> Path:
    out_dir = tmp_path_factory.mktemp(f"{request.param}_classifier")
    return build_tiny_classifier_checkpoint(request.param, out_dir, num_labels=NUM_LABELS)


def test_logits_equal_transformers(classifier_dir: Path) -> None:
    model = load_for_test(classifier_dir)
    assert isinstance(model, LlamaForSequenceClassification)
    assert not model.is_decoder and model.is_causal
    assert model.config.id2label == {i: f"label_{i}" for i in range(NUM_LABELS)}
    sequences = _sequences(model.config.vocab_size)
    logits = model.classify(packed_forward(model, sequences), [len(s) for s in sequences])

    reference_model = AutoModelForSequenceClassification.from_pretrained(classifier_dir).eval()
    with torch.no_grad():
        reference = torch.cat([reference_model(torch.tensor([s])).logits for s in sequences])
    assert logits.dtype == torch.float32 and logits.shape == (len(sequences), NUM_LABELS)
    assert reference.abs().max() > 0.5, "random logits too small to tell a mistake apart"
    torch.testing.assert_close(logits, reference, atol=1e-5, rtol=1e-5)


def test_labels_fall_back_to_transformers_names() -> None:
    # config.json keeps string keys; a hand-built config may name only some labels.
    hf_config = SimpleNamespace(num_labels=3, id2label={"0": "spam", 2: "ham"})
    assert num_labels_from_hf(hf_config) == 3
    assert id2label_from_hf(hf_config, 3) == {0: "spam", 1: "LABEL_1", 2: "ham"}
    assert id2label_from_hf(SimpleNamespace(), 2) == {0: "LABEL_0", 1: "LABEL_1"}


def test_has_no_lm_head(classifier_dir: Path) -> None:
    model = load_for_test(classifier_dir)
    with pytest.raises(TypeError, match="no LM head"):
        model.compute_logits(torch.zeros(1, model.config.hidden_size))
