"""Parameters of a pooling request (LLM.encode), with vLLM's names."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PoolingParams:
    """How LLM.encode finishes each input's hidden states.

    `use_activation`: the task's activation (embeddings normalized, per token for
    token_embed; class probabilities for classify); False gives the raw vectors or logits;
    None the model's default. `dimensions`: keep each embedding's first dimensions (Matryoshka),
    embeddings only.
    """

    use_activation: bool | None = None
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.use_activation is not None and not isinstance(self.use_activation, bool):
            raise ValueError(f"use_activation must be a bool or None, got {self.use_activation!r}")
        if self.dimensions is not None and (
            isinstance(self.dimensions, bool)
            or not isinstance(self.dimensions, int)
            or self.dimensions < 1
        ):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")
