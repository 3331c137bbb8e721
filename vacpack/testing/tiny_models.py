"""Tiny random-weight Hugging Face checkpoints, built on the fly for tests and demos.

Everything here is made locally from files bundled with vacpack: a byte-level BPE tokenizer
trained on `vacpack/data/tokenizer_corpus.txt`, and decoder-only models built with transformers
from a config and filled with seeded random weights. Nothing is downloaded and nothing is cached
between calls, so each checkpoint is a pure function of its arguments.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

END_OF_TEXT_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
# Order matters: the trainer gives special tokens the first ids, so <|endoftext|> is id 0.
SPECIAL_TOKENS: tuple[str, ...] = (END_OF_TEXT_TOKEN, IM_START_TOKEN, IM_END_TOKEN)

TOKENIZER_VOCAB_SIZE = 2048
# Pairs seen only once are mostly noise in a corpus this small; the corpus is large enough that
# the vocabulary still fills up to TOKENIZER_VOCAB_SIZE.
TOKENIZER_MIN_PAIR_FREQUENCY = 2

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# vacpack/data ships as package data beside the code (see pyproject.toml).
BUNDLED_DATA_DIR = Path(__file__).resolve().parent.parent / "data"
TOKENIZER_CORPUS_PATH = BUNDLED_DATA_DIR / "tokenizer_corpus.txt"
SAMPLE_PROMPTS_PATH = BUNDLED_DATA_DIR / "sample_prompts.jsonl"


def load_sample_prompts() -> list[str]:
    """The bundled demo and benchmark prompts, in file order."""
    lines = SAMPLE_PROMPTS_PATH.read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["prompt"] for line in lines if line.strip()]


def _train_byte_level_bpe(corpus_text: str, vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    # Digits are split one by one (as Qwen2 does) so numbers never merge into arbitrary chunks;
    # the byte-level step then maps every byte to a printable symbol, so any UTF-8 text,
    # emoji included, encodes without an unknown token and decodes back byte for byte.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=TOKENIZER_MIN_PAIR_FREQUENCY,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 byte symbols up front, so bytes absent from the corpus still encode.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_text.splitlines(keepends=True), trainer=trainer)
    return tokenizer


def _make_tokenizer() -> PreTrainedTokenizerFast:
    corpus_text = TOKENIZER_CORPUS_PATH.read_text(encoding="utf-8")
    backend = _train_byte_level_bpe(corpus_text, TOKENIZER_VOCAB_SIZE)
    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=None,
        unk_token=None,
        eos_token=END_OF_TEXT_TOKEN,
        pad_token=END_OF_TEXT_TOKEN,
        additional_special_tokens=[IM_START_TOKEN, IM_END_TOKEN],
    )
    hf_tokenizer.chat_template = CHATML_TEMPLATE
    return hf_tokenizer


def build_tokenizer(out_dir: Path) -> Path:
    """Train the byte-level BPE tokenizer on the bundled corpus and save it HF-style in out_dir.

    Training is deterministic (same corpus, same vocabulary and merges) and takes well under a
    second. Returns out_dir.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _make_tokenizer().save_pretrained(out_dir)
    return out_dir


@dataclass(frozen=True)
class FamilySpec:
    """How one decoder family differs from the plain Llama-style recipe."""

    model_type: str
    ties_word_embeddings_by_default: bool
    config_extras: Mapping[str, Any]


LLAMA3_ROPE_SCALING: Mapping[str, Any] = MappingProxyType(
    {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        # Small, so that tiny test sequences already reach the rescaled frequency band.
        "original_max_position_embeddings": 64,
    }
)

FAMILIES: Mapping[str, FamilySpec] = MappingProxyType(
    {
        "llama": FamilySpec("llama", False, MappingProxyType({})),
        # Passed as the transformers-4 style keywords, which transformers 5 folds into a single
        # `rope_parameters` dict (rope_theta included) when it builds and saves the config.
        "llama3": FamilySpec(
            "llama",
            False,
            MappingProxyType({"rope_theta": 500000.0, "rope_scaling": dict(LLAMA3_ROPE_SCALING)}),
        ),
        # Mistral's default 4096-token sliding window is inert below 1024 positions; dropping it
        # (as Mistral v0.3 does) keeps the config free of a feature the model never uses.
        "mistral": FamilySpec("mistral", False, MappingProxyType({"sliding_window": None})),
        # Qwen2's q/k/v biases are hard-wired in the model class, not a config switch.
        "qwen2": FamilySpec("qwen2", True, MappingProxyType({})),
        "qwen3": FamilySpec("qwen3", True, MappingProxyType({"attention_bias": False})),
        # Windows and caps small enough that tiny prompts cross them and tiny logits reach the
        # tanh's bend; a query scale other than head_dim's.
        "gemma2": FamilySpec(
            "gemma2",
            True,
            MappingProxyType(
                {
                    "sliding_window": 24,
                    "query_pre_attn_scalar": 24,
                    "attn_logit_softcapping": 3.0,
                    "final_logit_softcapping": 6.0,
                }
            ),
        ),
        # Layer 0 slides (local rope base 10,000), layer 1 is global (base 1,000,000).
        "gemma3": FamilySpec(
            "gemma3_text",
            True,
            MappingProxyType(
                {
                    "sliding_window": 24,
                    "query_pre_attn_scalar": 24,
                    "layer_types": ["sliding_attention", "full_attention"],
                }
            ),
        ),
        "phi3": FamilySpec("phi3", False, MappingProxyType({})),
        "mixtral": FamilySpec(
            "mixtral", False, MappingProxyType({"num_local_experts": 4, "num_experts_per_tok": 2})
        ),
        # A shared expert with its gate, top-k weights left unnormalised.
        "qwen2_moe": FamilySpec(
            "qwen2_moe",
            False,
            MappingProxyType(
                {
                    "num_experts": 4,
                    "num_experts_per_tok": 2,
                    "moe_intermediate_size": 32,
                    "shared_expert_intermediate_size": 48,
                    "norm_topk_prob": False,
                }
            ),
        ),
        # Eight experts with normalised top-2 weights; layer 1 is a dense MLP.
        "qwen3_moe": FamilySpec(
            "qwen3_moe",
            False,
            MappingProxyType(
                {
                    "num_experts": 8,
                    "num_experts_per_tok": 2,
                    "moe_intermediate_size": 32,
                    "norm_topk_prob": True,
                    "mlp_only_layers": [1],
                }
            ),
        ),
    }
)


@dataclass(frozen=True)
class TinyShape:
    """Shapes small enough that a checkpoint builds, saves and loads in well under a second."""

    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    max_position_embeddings: int = 1024

    def as_config_kwargs(self) -> dict[str, int]:
        return {
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": self.max_position_embeddings,
        }


@dataclass(frozen=True)
class RandomWeightInit:
    """Standard deviations for the random weights: matrices, biases, and norm scales around 1."""

    matrix_std: float
    bias_std: float
    norm_scale_std: float


# Much wider than a trained model's init so that logits spread over several units and greedy
# argmax rarely meets a near-tie that float reordering in another kernel could flip.
TINY_WEIGHT_INIT = RandomWeightInit(matrix_std=0.2, bias_std=0.2, norm_scale_std=0.1)
# Realistic magnitudes for full-size benchmark models, where only the shapes matter.
BENCHMARK_WEIGHT_INIT = RandomWeightInit(matrix_std=0.02, bias_std=0.02, norm_scale_std=0.0)


def _family_spec(family: str) -> FamilySpec:
    try:
        return FAMILIES[family]
    except KeyError:
        known = ", ".join(sorted(FAMILIES))
        raise ValueError(f"unknown model family {family!r}; expected one of: {known}") from None


@torch.no_grad()
def _fill_random_weights(model: PreTrainedModel, init: RandomWeightInit, seed: int) -> None:
    # A private generator keeps the global torch RNG untouched, so building a checkpoint inside
    # a test never changes what later random draws in that test produce.
    generator = torch.Generator(device="cpu").manual_seed(seed)
    # named_parameters() yields a tied weight once, so a tied lm_head keeps the embedding values.
    for parameter_name, parameter in model.named_parameters():
        if parameter.ndim >= 2:
            parameter.normal_(mean=0.0, std=init.matrix_std, generator=generator)
        elif parameter_name.endswith(".bias"):
            parameter.normal_(mean=0.0, std=init.bias_std, generator=generator)
        elif init.norm_scale_std > 0.0:
            # In these families every other 1-D weight is an RMSNorm scale.
            parameter.normal_(mean=1.0, std=init.norm_scale_std, generator=generator)
        else:
            parameter.fill_(1.0)


def _build_random_model(
    config: PretrainedConfig,
    dtype: torch.dtype,
    init: RandomWeightInit,
    seed: int,
    auto_class: Any = AutoModelForCausalLM,  # an Auto* class: from_config builds the model
) -> PreTrainedModel:
    # Built on the meta device and then given real storage once, so a large model is never held
    # twice (no throwaway default init, no float32 copy before a cast to bfloat16).
    # Cast while still on meta (free) rather than passing a dtype keyword, whose name changed
    # between transformers 4 (torch_dtype) and 5 (dtype).
    with torch.device("meta"):
        model = auto_class.from_config(config).to(dtype)
    model.to_empty(device="cpu")
    # to_empty gives each module its own fresh tensor, which splits a tied lm_head from the
    # embedding; re-tie before filling so both share the same values on save.
    model.tie_weights()
    _fill_random_weights(model, init, seed)
    # Non-persistent buffers such as RoPE inv_freq are left uninitialised by to_empty; they are
    # not saved, and from_pretrained recomputes them, so this model object is for saving only.
    return model


def _save_checkpoint(
    config_kwargs: Mapping[str, Any],
    family: str,
    out_dir: Path,
    *,
    dtype: torch.dtype,
    seed: int,
    init: RandomWeightInit,
    max_shard_bytes: int | None,
    auto_class: Any = AutoModelForCausalLM,  # an Auto* class: from_config builds the model
) -> Path:
    out_dir = Path(out_dir)
    spec = _family_spec(family)
    tokenizer = _make_tokenizer()
    all_config_kwargs: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "tie_word_embeddings": spec.ties_word_embeddings_by_default,
        # A deep copy, because transformers may edit nested dicts such as rope_scaling in place.
        **copy.deepcopy(dict(spec.config_extras)),
        **config_kwargs,
        # The ids must name our tokenizer's tokens, whatever the family's defaults say.
        "bos_token_id": None,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    config = AutoConfig.for_model(spec.model_type, **all_config_kwargs)
    model = _build_random_model(config, dtype, init, seed, auto_class)
    if max_shard_bytes is None:
        model.save_pretrained(out_dir)
    else:
        model.save_pretrained(out_dir, max_shard_size=max_shard_bytes)
    # Written last so it replaces whatever save_pretrained derived from the model config.
    generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def build_tiny_checkpoint(
    family: str,
    out_dir: Path,
    *,
    seed: int = 0,
    tie_word_embeddings: bool | None = None,
    max_shard_bytes: int | None = None,
    dtype: torch.dtype = torch.float32,
    **config_overrides: Any,
) -> Path:
    """Build and save a tiny random-weight checkpoint of one decoder family into out_dir.

    family is one of FAMILIES ("llama", "llama3", "mistral", "qwen2", "qwen3", "gemma2", "gemma3",
    "phi3", "mixtral", "qwen2_moe", "qwen3_moe"). The shapes are
    TinyShape's, the vocabulary is the trained tokenizer's, and config_overrides replace any
    config field. tie_word_embeddings None keeps the family's default (Llama and Mistral untied,
    Qwen tied). max_shard_bytes splits the weights into several safetensors files plus an index.
    Returns out_dir.
    """
    config_kwargs: dict[str, Any] = {**TinyShape().as_config_kwargs(), **config_overrides}
    if tie_word_embeddings is not None:
        config_kwargs["tie_word_embeddings"] = tie_word_embeddings
    return _save_checkpoint(
        config_kwargs,
        family,
        out_dir,
        dtype=dtype,
        seed=seed,
        init=TINY_WEIGHT_INIT,
        max_shard_bytes=max_shard_bytes,
    )


def build_tiny_classifier_checkpoint(
    family: str,
    out_dir: Path,
    num_labels: int = 3,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **config_overrides: Any,
) -> Path:
    """Like build_tiny_checkpoint, but a {Family}ForSequenceClassification with num_labels.

    The labels are named label_0 ... so that a test can tell them from transformers' default
    LABEL_i names. Returns out_dir.
    """
    config_kwargs: dict[str, Any] = {
        **TinyShape().as_config_kwargs(),
        "id2label": {index: f"label_{index}" for index in range(num_labels)},
        **config_overrides,
    }
    return _save_checkpoint(
        config_kwargs,
        family,
        out_dir,
        dtype=dtype,
        seed=seed,
        init=TINY_WEIGHT_INIT,
        max_shard_bytes=None,
        auto_class=AutoModelForSequenceClassification,
    )


def qwen2_5_0_5b_shapes() -> dict[str, Any]:
    """Config fields giving the exact shapes of Qwen2.5-0.5B, for random-weight benchmarks."""
    return {
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        # Explicit, so a family whose default head_dim is not hidden/heads (qwen3) still matches.
        "head_dim": 64,
        "intermediate_size": 4864,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "use_sliding_window": False,
    }


def build_random_checkpoint(
    config_overrides: Mapping[str, Any],
    family: str,
    out_dir: Path,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> Path:
    """Build and save a random-weight checkpoint of any size, e.g. with qwen2_5_0_5b_shapes().

    Fields not in config_overrides take the family's extras (such as llama3 RoPE scaling) and
    then transformers' defaults, except vocab_size, which defaults to the tokenizer's. The
    config's vocab_size may exceed the tokenizer's (encoding never produces the extra ids), and
    our tokenizer is saved beside the weights either way. Weights are drawn with a realistic std
    of 0.02 directly in dtype, without a second copy. Returns out_dir.
    """
    return _save_checkpoint(
        config_overrides,
        family,
        out_dir,
        dtype=dtype,
        seed=seed,
        init=BENCHMARK_WEIGHT_INIT,
        max_shard_bytes=None,
    )
