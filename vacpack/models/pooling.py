"""One vector per sequence from a packed hidden-state stream, as sentence-transformers pools.

A checkpoint's pooling comes from its sentence-transformers files when it has them
(`modules.json`, the Pooling module's `config.json`, a Normalize module); otherwise from the
caller's default. `pool` reduces every sequence of the packed stream at once, with no loop over
sequences and no padding. A Matryoshka `dimensions` keeps each vector's first dimensions and
normalizes after cutting, as vLLM does, so a normalized embedding stays of unit length.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F

POOLING_STRATEGIES: tuple[str, ...] = ("cls", "mean", "last", "max")

# sentence-transformers' `pooling_mode` values, and the legacy boolean keys older Pooling configs
# use, mapped to our strategies. None marks a mode it has and we do not.
_ST_POOLING_MODES: Mapping[str, str | None] = MappingProxyType(
    {
        "cls": "cls",
        "mean": "mean",
        "max": "max",
        "lasttoken": "last",
        "mean_sqrt_len_tokens": None,
        "weightedmean": None,
    }
)
_ST_LEGACY_POOLING_KEYS: Mapping[str, str] = MappingProxyType(
    {
        "pooling_mode_cls_token": "cls",
        "pooling_mode_mean_tokens": "mean",
        "pooling_mode_max_tokens": "max",
        "pooling_mode_lasttoken": "lasttoken",
        "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
        "pooling_mode_weightedmean_tokens": "weightedmean",
    }
)
# The sentence-transformers modules whose effect we reproduce. Anything else in modules.json
# (Dense projections, extra LayerNorms, ...) would change the embedding, so it is refused.
_ST_TRANSFORMER, _ST_POOLING, _ST_NORMALIZE = "Transformer", "Pooling", "Normalize"


@dataclass(frozen=True)
class PoolingConfig:
    strategy: str  # one of POOLING_STRATEGIES
    normalize: bool  # scale each pooled vector to unit L2 norm
    dimensions: int | None = None  # keep only the first dimensions (Matryoshka); None: all
    # False: sentence-transformers leaves an instruction prompt's tokens out of a mean or max.
    include_prompt: bool = True

    def __post_init__(self) -> None:
        if self.strategy not in POOLING_STRATEGIES:
            raise ValueError(
                f"pooling strategy {self.strategy!r} is not supported; "
                f"expected one of {POOLING_STRATEGIES}"
            )
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be at least 1, got {self.dimensions}")


def check_dimensions(dimensions: int, embedding_size: int, hf_config: Any) -> None:
    """Raises ValueError unless the model's embeddings may be cut to `dimensions`.

    Above the embedding size is refused, and so is a size outside the checkpoint's declared
    `matryoshka_dimensions`, or any size when its config says `is_matryoshka: false`. A model
    that declares nothing may be cut (OpenAI's API allows it; the caller knows the model).
    """
    if isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1:
        raise ValueError(f"dimensions must be a positive integer, got {dimensions!r}")
    if dimensions > embedding_size:
        raise ValueError(
            f"dimensions {dimensions} is more than the model's embedding size {embedding_size}"
        )
    if getattr(hf_config, "is_matryoshka", None) is False:
        raise ValueError(
            "the model does not support matryoshka representation (its config says "
            "is_matryoshka: false); changing output dimensions would give poor results"
        )
    declared = getattr(hf_config, "matryoshka_dimensions", None)
    if declared and dimensions not in declared:
        raise ValueError(f"the model supports only the matryoshka dimensions {list(declared)}")


def pooling_config_for(
    model_dir: Path, hf_config: Any, default_strategy: str, default_normalize: bool = False
) -> PoolingConfig:
    """The checkpoint's own pooling when it ships sentence-transformers files, else the default.

    Raises ValueError for a sentence-transformers pipeline we cannot reproduce exactly (a Dense
    layer, several pooling modes concatenated, weighted-mean pooling, ...).
    """
    modules_path = Path(model_dir) / "modules.json"
    if not modules_path.is_file():
        return PoolingConfig(default_strategy, default_normalize)
    strategy, normalize, include_prompt = default_strategy, False, True
    for module in json.loads(modules_path.read_text(encoding="utf-8")):
        # Both the legacy ("sentence_transformers.models.Pooling") and the current, longer
        # module paths end in the class name.
        kind = str(module.get("type", "")).rpartition(".")[2]
        if kind == _ST_POOLING:
            config_path = Path(model_dir) / module.get("path", "") / "config.json"
            pooling = json.loads(config_path.read_text(encoding="utf-8"))
            strategy = _strategy_from_st_pooling(pooling)
            _check_embedding_size(pooling, hf_config)
            include_prompt = pooling.get("include_prompt") is not False
        elif kind == _ST_NORMALIZE:
            normalize = True
        elif kind != _ST_TRANSFORMER:
            raise ValueError(
                f"{str(modules_path)!r}: sentence-transformers module {module.get('type')!r} "
                "is not supported (only Transformer, Pooling and Normalize)"
            )
    return PoolingConfig(strategy, normalize, include_prompt=include_prompt)


def _strategy_from_st_pooling(pooling: Mapping[str, Any]) -> str:
    modes = pooling.get("pooling_mode")
    if modes is None:
        modes = [mode for key, mode in _ST_LEGACY_POOLING_KEYS.items() if pooling.get(key)]
        # sentence-transformers falls back to mean pooling when no legacy flag is set.
        modes = modes or ["mean"]
    if isinstance(modes, str):
        modes = [modes]
    if len(modes) != 1:
        raise ValueError(f"concatenated pooling modes {list(modes)} are not supported")
    if modes[0] not in _ST_POOLING_MODES:
        raise ValueError(f"unknown sentence-transformers pooling mode {modes[0]!r}")
    strategy = _ST_POOLING_MODES[modes[0]]
    if strategy is None:
        raise ValueError(f"sentence-transformers pooling mode {modes[0]!r} is not supported")
    return strategy


def _check_embedding_size(pooling: Mapping[str, Any], hf_config: Any) -> None:
    embedding_size = pooling.get("embedding_dimension", pooling.get("word_embedding_dimension"))
    hidden_size = getattr(hf_config, "hidden_size", None)
    if embedding_size is not None and hidden_size is not None and embedding_size != hidden_size:
        raise ValueError(
            f"the Pooling module expects {embedding_size}-dim token embeddings but the model's "
            f"hidden size is {hidden_size}"
        )


def sentence_transformers_prompts(model_dir: Path) -> tuple[dict[str, str], str | None]:
    """The checkpoint's named prompts (instruction prefixes) and the one applied by default."""
    path = Path(model_dir) / "config_sentence_transformers.json"
    if not path.is_file():
        return {}, None
    config = json.loads(path.read_text(encoding="utf-8"))
    prompts = {str(name): str(text) for name, text in (config.get("prompts") or {}).items()}
    return prompts, config.get("default_prompt_name") or None


def sentence_transformers_max_len(model_dir: Path) -> int | None:
    """The max_seq_length a sentence-transformers checkpoint cuts its inputs to, if it sets one."""
    path = Path(model_dir) / "sentence_bert_config.json"
    if not path.is_file():
        return None
    value = json.loads(path.read_text(encoding="utf-8")).get("max_seq_length")
    return int(value) if value else None


def pool(hidden: torch.Tensor, seq_lens: Sequence[int], config: PoolingConfig) -> torch.Tensor:
    """[num_tokens, hidden] packed rows -> [num_seqs, hidden] float32, one row per sequence.

    Sequence i owns the seq_lens[i] consecutive rows after those of sequences 0..i-1.
    """
    if not seq_lens or min(seq_lens) < 1:
        raise ValueError("pooling needs at least one sequence, each at least one token long")
    if sum(seq_lens) != hidden.shape[0]:
        raise ValueError(f"seq_lens cover {sum(seq_lens)} tokens but hidden has {hidden.shape[0]}")
    lengths = torch.tensor(seq_lens, dtype=torch.int64).to(hidden.device, non_blocking=True)
    if config.strategy in ("cls", "last"):
        ends = lengths.cumsum(0)
        rows = ends - lengths if config.strategy == "cls" else ends - 1
        pooled = hidden.index_select(0, rows).float()
    else:
        # Reduced in float32 as sentence-transformers does for a float32 model; for bf16 hidden
        # states this also keeps the sum of a long sequence from losing precision.
        reduction = "mean" if config.strategy == "mean" else "max"
        pooled = torch.segment_reduce(hidden.float(), reduction, lengths=lengths, axis=0)
    if config.dimensions is not None:
        pooled = pooled[:, : config.dimensions]
    return F.normalize(pooled, p=2.0, dim=-1) if config.normalize else pooled
