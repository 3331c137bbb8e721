"""Packed pooling against a per-sequence loop; pooling settings from sentence-transformers."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from vacpack.models.pooling import POOLING_STRATEGIES, PoolingConfig, pool, pooling_config_for

SEQ_LENS = [1, 3, 7, 2, 5]
HIDDEN_SIZE = 8
HF_CONFIG = SimpleNamespace(hidden_size=HIDDEN_SIZE)


def _reference_pool(hidden: torch.Tensor, config: PoolingConfig) -> torch.Tensor:
    reduce = {
        "cls": lambda rows: rows[0],
        "last": lambda rows: rows[-1],
        "mean": lambda rows: rows.mean(0),
        "max": lambda rows: rows.max(0).values,
    }[config.strategy]
    pooled = torch.stack([reduce(rows.float()) for rows in hidden.split(SEQ_LENS)])
    return F.normalize(pooled, dim=-1) if config.normalize else pooled


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("strategy", POOLING_STRATEGIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pool_equals_per_sequence_loop(strategy: str, normalize: bool, dtype: torch.dtype) -> None:
    hidden = torch.randn(sum(SEQ_LENS), HIDDEN_SIZE, generator=torch.Generator().manual_seed(0))
    hidden = hidden.to(dtype)
    config = PoolingConfig(strategy, normalize)
    pooled = pool(hidden, SEQ_LENS, config)
    assert pooled.dtype == torch.float32 and pooled.shape == (len(SEQ_LENS), HIDDEN_SIZE)
    torch.testing.assert_close(pooled, _reference_pool(hidden, config))


def test_pool_rejects_lengths_that_do_not_cover_the_stream() -> None:
    config = PoolingConfig("mean", normalize=False)
    with pytest.raises(ValueError, match="cover"):
        pool(torch.zeros(4, HIDDEN_SIZE), [1, 2], config)
    with pytest.raises(ValueError, match="at least one token"):
        pool(torch.zeros(4, HIDDEN_SIZE), [4, 0], config)
    with pytest.raises(ValueError, match="not supported"):
        PoolingConfig("weightedmean", normalize=False)


def _write_st_files(model_dir: Path, pooling: dict[str, Any] | None, extra_types=()) -> Path:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
    ]
    if pooling is not None:
        modules.append(
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.Pooling"}
        )
        (model_dir / "1_Pooling").mkdir()
        (model_dir / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    for index, module_type in enumerate(extra_types, start=len(modules)):
        modules.append({"idx": index, "name": str(index), "path": "", "type": module_type})
    (model_dir / "modules.json").write_text(json.dumps(modules))
    return model_dir


def test_without_sentence_transformers_files_the_default_applies(tmp_path: Path) -> None:
    assert pooling_config_for(tmp_path, HF_CONFIG, "last") == PoolingConfig("last", False)


@pytest.mark.parametrize(
    ("pooling", "extra_types", "expected"),
    [
        # Legacy boolean flags, with and without a Normalize module.
        (
            {"word_embedding_dimension": HIDDEN_SIZE, "pooling_mode_cls_token": True},
            ["sentence_transformers.models.Normalize"],
            PoolingConfig("cls", True),
        ),
        ({"pooling_mode_max_tokens": True}, [], PoolingConfig("max", False)),
        ({"pooling_mode_lasttoken": True}, [], PoolingConfig("last", False)),
        # No flag set: sentence-transformers pools the mean.
        ({"pooling_mode_cls_token": False}, [], PoolingConfig("mean", False)),
        # The current format: one pooling_mode string, and the longer module path.
        (
            {"embedding_dimension": HIDDEN_SIZE, "pooling_mode": "lasttoken"},
            ["sentence_transformers.base.modules.normalize.Normalize"],
            PoolingConfig("last", True),
        ),
        # A Normalize module but no Pooling module: the default strategy, normalised.
        (None, ["sentence_transformers.models.Normalize"], PoolingConfig("cls", True)),
    ],
)
def test_sentence_transformers_pooling_is_honoured(
    tmp_path: Path, pooling: dict[str, Any] | None, extra_types: list[str], expected: PoolingConfig
) -> None:
    model_dir = _write_st_files(tmp_path, pooling, extra_types)
    assert pooling_config_for(model_dir, HF_CONFIG, default_strategy="cls") == expected


@pytest.mark.parametrize(
    ("pooling", "extra_types", "error"),
    [
        ({"pooling_mode": "weightedmean"}, [], "not supported"),
        ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True}, [], "concatenated"),
        ({"pooling_mode": "mean"}, ["sentence_transformers.models.Dense"], "Dense"),
        ({"embedding_dimension": HIDDEN_SIZE + 1, "pooling_mode": "mean"}, [], "hidden size"),
    ],
)
def test_pipelines_we_cannot_reproduce_are_refused(
    tmp_path: Path, pooling: dict[str, Any], extra_types: list[str], error: str
) -> None:
    model_dir = _write_st_files(tmp_path, pooling, extra_types)
    with pytest.raises(ValueError, match=error):
        pooling_config_for(model_dir, HF_CONFIG, default_strategy="cls")
