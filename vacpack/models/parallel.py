"""Tensor-parallel layout of the linear layers.

Every linear layer is either column-parallel (its output features are split across ranks) or
row-parallel (its input features are split, and the partial products are summed with one
all-reduce). A transformer block then needs exactly one all-reduce after attention and one after
the MLP. With a single rank every layer is a plain dense linear and no collective runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from vacpack.models.cpu_prepack import meta_like, packed_linear, prepack


@dataclass(frozen=True)
class TensorParallel:
    """Which shard of each layer this process holds."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor parallel rank {self.rank} is outside 0..{self.size - 1}")

    def split(self, num_features: int, what: str) -> int:
        if num_features % self.size:
            raise ValueError(f"{what} ({num_features}) is not divisible by tp size {self.size}")
        return num_features // self.size


SINGLE_RANK = TensorParallel()

# The shard index of a checkpoint tensor that holds all of a merged layer's shards already
# concatenated (Phi-3's qkv_proj and gate_up_proj): each rank takes its slice of every part.
ALL_SHARDS = -1


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's output rows split across ranks; each rank keeps its own slice of y.

    `shard_sizes` lists the full output sizes of the checkpoint tensors merged into this layer
    (for example q, k and v), so one matmul replaces several.
    """

    def __init__(
        self,
        input_size: int,
        shard_sizes: list[int],
        bias: bool,
        tp: TensorParallel = SINGLE_RANK,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.local_shard_sizes = [tp.split(size, "output features") for size in shard_sizes]
        output_size = sum(self.local_shard_sizes)
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None
        self.packed_weight: torch.Tensor | None = None

    def load_shard(self, name: str, tensor: torch.Tensor, shard_index: int = 0) -> None:
        """Copies this rank's slice of checkpoint tensor `shard_index` into its place."""
        if shard_index == ALL_SHARDS:
            full_sizes = [size * self.tp.size for size in self.local_shard_sizes]
            if tensor.shape[0] != sum(full_sizes):
                raise ValueError(
                    f"a fused {name} of {tensor.shape[0]} rows does not split into {full_sizes}"
                )
            for index, part in enumerate(tensor.split(full_sizes)):
                self.load_shard(name, part, index)
            return
        param = self.weight if name == "weight" else self.bias
        assert param is not None, f"checkpoint has a {name} this layer does not"
        local_size = self.local_shard_sizes[shard_index]
        offset = sum(self.local_shard_sizes[:shard_index])
        rank_slice = tensor.narrow(0, self.tp.rank * local_size, local_size)
        param.data.narrow(0, offset, local_size).copy_(rank_slice)

    def prepack_for_cpu(self) -> None:
        """Call once loading is done: the weight in oneDNN's layout (cpu_prepack.py)."""
        _prepack_weight(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None:
            return packed_linear(x, self.packed_weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class QKVParallelLinear(ColumnParallelLinear):
    """Query, key and value projections merged into one column-parallel matmul."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        tp: TensorParallel = SINGLE_RANK,
    ) -> None:
        kv_size = num_kv_heads * head_dim
        super().__init__(hidden_size, [num_heads * head_dim, kv_size, kv_size], bias, tp)


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's input columns split across ranks; partial sums are all-reduced,
    unless reduce_results is False: then the caller sums several such layers' partial results
    and reduces once (a mixture of experts)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        tp: TensorParallel = SINGLE_RANK,
        reduce_results: bool = True,
    ) -> None:
        super().__init__()
        if bias and not reduce_results:
            raise ValueError("a bias must be added once, after the reduction")
        self.tp = tp
        self.reduce_results = reduce_results
        self.local_input_size = tp.split(input_size, "input features")
        self.weight = nn.Parameter(
            torch.empty(output_size, self.local_input_size), requires_grad=False
        )
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None
        self.packed_weight: torch.Tensor | None = None

    def load_shard(self, name: str, tensor: torch.Tensor, shard_index: int = 0) -> None:
        if name == "bias":
            assert self.bias is not None, "checkpoint has a bias this layer does not"
            self.bias.data.copy_(tensor)
            return
        start = self.tp.rank * self.local_input_size
        self.weight.data.copy_(tensor.narrow(1, start, self.local_input_size))

    def prepack_for_cpu(self) -> None:
        """Call once loading is done: the weight in oneDNN's layout (cpu_prepack.py)."""
        _prepack_weight(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The bias is added once, after the reduction, not once per rank.
        if self.packed_weight is not None:
            y = packed_linear(x, self.packed_weight, None)
        else:
            y = F.linear(x, self.weight)
        if self.tp.size > 1 and self.reduce_results:
            dist.all_reduce(y)
        return y if self.bias is None else y + self.bias


class VocabEmbedding(nn.Module):
    """Token embedding table, which may double as the LM head (tied embeddings); sharding it by
    vocabulary is left to the tensor-parallel issue."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        self.packed_weight: torch.Tensor | None = None

    def load_shard(self, name: str, tensor: torch.Tensor, shard_index: int = 0) -> None:
        self.weight.data.copy_(tensor)

    def prepack_for_cpu(self) -> None:
        """A packed copy for `project`; the plain table stays for the lookups."""
        self.packed_weight = prepack(self.weight)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.weight)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the vocabulary: hidden @ table^T, in the table's dtype."""
        if self.packed_weight is not None:
            return packed_linear(hidden, self.packed_weight, None)
        return F.linear(hidden, self.weight)


class LMHead(VocabEmbedding):
    """An untied LM head: it only projects, so once packed its plain table is dropped."""

    def prepack_for_cpu(self) -> None:
        super().prepack_for_cpu()
        if self.packed_weight is not None:
            self.weight = meta_like(self.weight)


def _prepack_weight(layer: ColumnParallelLinear | RowParallelLinear) -> None:
    layer.packed_weight = prepack(layer.weight)
    if layer.packed_weight is not None:
        layer.weight = meta_like(layer.weight)


def prepack_linear_weights(model: nn.Module) -> int:
    """Packs `model`'s linear layers and its LM head, if it has one, where they can be (a no-op
    off the CPU); returns how many were packed."""
    layers: list[ColumnParallelLinear | RowParallelLinear | VocabEmbedding] = [
        m for m in model.modules() if isinstance(m, ColumnParallelLinear | RowParallelLinear)
    ]
    lm_head = getattr(model, "lm_head", None)
    if isinstance(lm_head, VocabEmbedding):
        layers.append(lm_head)
    for layer in layers:
        layer.prepack_for_cpu()
    return sum(layer.packed_weight is not None for layer in layers)
