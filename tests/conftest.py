"""Shared pytest fixtures."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from vacpack.testing.tiny_models import build_tiny_checkpoint

TinyCheckpointFactory = Callable[..., Path]


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpointFactory:
    """Factory `(family, **build_tiny_checkpoint_kwargs) -> checkpoint dir`, built once per session.

    Checkpoints are shared between tests, so tests must treat the returned directory as
    read-only.
    """
    root_dir = tmp_path_factory.mktemp("tiny_checkpoints")
    built_dirs: dict[str, Path] = {}

    def build_or_reuse(family: str, **build_kwargs: Any) -> Path:
        # repr, not the kwargs themselves, because overrides such as rope_scaling are dicts.
        cache_key = repr((family, sorted(build_kwargs.items())))
        if cache_key not in built_dirs:
            out_dir = root_dir / f"{family}-{len(built_dirs)}"
            built_dirs[cache_key] = build_tiny_checkpoint(family, out_dir, **build_kwargs)
        return built_dirs[cache_key]

    return build_or_reuse
