"""What every model family implements, so the loader, the engine and corpus jobs can run any.

A model takes one packed 1-D stream of tokens (no batch axis: positions restart at 0 for every
sequence, and the attention backend keeps sequences apart) and returns one hidden state per
token. Decoders also project chosen rows to logits; classifiers and encoders turn hidden states
into their outputs in the corpus tasks.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from torch import nn

from vacpack.models.forward_context import ForwardContext


class PackedModel(nn.Module):
    # The family's configuration class: `config_class.from_hf(hf_config)` builds `config`.
    config_class: ClassVar[Any]
    is_decoder: ClassVar[bool] = False  # generates: has an LM head and a KV cache layout
    # The elementwise ops of layer_ops.py its layers call (a decoder block's RMSNorm, SiLU*up
    # and rotary; a post-norm encoder block's residual add with LayerNorm), whose
    # implementations are timed at load.
    layer_ops_used: ClassVar[tuple[str, ...]] = ()
    # Its layers are decoder blocks (a gated MLP), whose linears run prefills and decode steps.
    decoder_layers: ClassVar[bool] = False
    # Honours ForwardContext.output_rows: returns the hidden states of those rows alone.
    prunes_output_rows: ClassVar[bool] = False
    config: Any

    @abstractmethod
    def checkpoint_name(self, hf_name: str) -> tuple[str, int] | None:
        """Maps a checkpoint tensor name to (our parameter name, shard index); None skips it."""

    def finish_loading(self) -> None:
        """Called once every weight is in place (caches derived from the weights go here)."""

    def limit_context(self, max_model_len: int) -> None:
        """The longest sequence that will run is `max_model_len` tokens (some RoPE scalings
        pick their frequencies by it)."""

    @abstractmethod
    def forward(
        self, token_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """Hidden states, one row per token of the packed stream."""

    def compute_logits(
        self, hidden: torch.Tensor, dtype: torch.dtype | None = torch.float32
    ) -> torch.Tensor:
        """Logits for the given rows (decoders and classifiers)."""
        raise NotImplementedError(f"{type(self).__name__} computes no logits")


@runtime_checkable
class SequenceClassifier(Protocol):
    """A model with a classification head: label logits, one row per packed sequence."""

    def classify(self, hidden: torch.Tensor, seq_lens: Sequence[int]) -> torch.Tensor: ...


class TensorSource(Protocol):
    """A checkpoint tensor not read yet: a layer reads only the part its rank keeps."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    def read(self, dim: int = 0, start: int = 0, length: int | None = None) -> torch.Tensor:
        """`length` entries from `start` along `dim` (all of it by default), in the model's
        dtype and on its device."""
        ...


@runtime_checkable
class ShardedParameters(Protocol):
    """A layer that places (a shard of) a checkpoint tensor itself: merged projections such as
    qkv, and tensor-parallel slices."""

    def checkpoint_shape(self, name: str, shard_index: int = 0) -> tuple[int, ...]:
        """The full shape the checkpoint tensor must have (all ranks' parts), checked before
        it is read."""
        ...

    def load_shard(self, name: str, source: TensorSource, shard_index: int = 0) -> None: ...
