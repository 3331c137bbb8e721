"""The random-weight checkpoints the benchmarks run on: the shapes of the benchmark models, where
each checkpoint is cached, and building one once (later runs reuse it)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from harness import REPO_ROOT, log

CHECKPOINT_CACHE_DIR = REPO_ROOT / "bench" / ".cache"
# Random weights with the exact shapes of Qwen2.5-0.5B: built once, shared by G1, O1 and P1.
QWEN2_5_0_5B_SHAPES_DIR = CHECKPOINT_CACHE_DIR / "g1-qwen2.5-0.5b-shapes"
# The same for Qwen2.5-1.5B, G1's second model size.
QWEN2_5_1_5B_SHAPES_DIR = CHECKPOINT_CACHE_DIR / "g1-qwen2.5-1.5b-shapes"


def qwen2_5_1_5b_shapes() -> dict[str, Any]:
    """Config fields giving the exact shapes of Qwen2.5-1.5B, for random-weight benchmarks."""
    return {
        "hidden_size": 1536,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "intermediate_size": 8960,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "use_sliding_window": False,
    }


# Where each named shape's random-weight checkpoint is built by default.
MODEL_SHAPE_DIRS: dict[str, Path] = {
    "qwen2.5-0.5b": QWEN2_5_0_5B_SHAPES_DIR,
    "qwen2.5-1.5b": QWEN2_5_1_5B_SHAPES_DIR,
}


def model_shapes(shape: str) -> dict[str, Any]:
    """The config fields of a named model shape (a key of MODEL_SHAPE_DIRS)."""
    if shape == "qwen2.5-0.5b":
        from vacpack.testing.tiny_models import qwen2_5_0_5b_shapes

        return qwen2_5_0_5b_shapes()
    if shape == "qwen2.5-1.5b":
        return qwen2_5_1_5b_shapes()
    raise ValueError(f"unknown model shape {shape!r}; known: {', '.join(MODEL_SHAPE_DIRS)}")


def ensure_shapes_checkpoint(shape: str, model_dir: Path, log_prefix: str) -> Path:
    """Builds the random-weight checkpoint of a named shape once; later runs reuse it."""
    if (model_dir / "config.json").exists():
        return model_dir
    from vacpack.testing.tiny_models import build_random_checkpoint

    config = model_shapes(shape)
    log(f"building the random-weight {shape}-shaped checkpoint in {model_dir}", log_prefix)
    # Built beside the target and renamed into place, so an interrupted build never leaves a
    # half-written directory that a later run would take for a finished one.
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    partial_dir = model_dir.with_name(f"{model_dir.name}.partial-{os.getpid()}")
    build_random_checkpoint(config, "qwen2", partial_dir)
    partial_dir.rename(model_dir)
    return model_dir


def ensure_qwen2_5_0_5b_shapes_checkpoint(model_dir: Path, log_prefix: str) -> Path:
    """Builds the random-weight Qwen2.5-0.5B-shaped checkpoint once; later runs reuse it."""
    return ensure_shapes_checkpoint("qwen2.5-0.5b", model_dir, log_prefix)


def ensure_qwen2_5_1_5b_shapes_checkpoint(model_dir: Path, log_prefix: str) -> Path:
    """Builds the random-weight Qwen2.5-1.5B-shaped checkpoint once; later runs reuse it."""
    return ensure_shapes_checkpoint("qwen2.5-1.5b", model_dir, log_prefix)
