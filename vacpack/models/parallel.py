"""Tensor-parallel layout of the linear layers and the vocabulary.

Every linear layer is either column-parallel (its output features are split across ranks) or
row-parallel (its input features are split, and the partial products are summed with one
all-reduce). A transformer block then needs exactly one all-reduce after attention and one after
the MLP. The vocabulary (token embedding and LM head) is split by rows: each rank looks up the
tokens it holds and the rows are summed, and each rank projects onto its share of the
vocabulary, which rank 0 gathers. With a single rank every layer is a plain dense layer and no
collective runs.

Each layer reads only its own slice of a checkpoint tensor (`load_shard` with a TensorSource):
no rank ever holds a whole sharded weight, even while loading.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeAlias

import torch
import torch.nn.functional as F
from torch import nn

from vacpack.cpu_kernels.gemm import GemmWeight
from vacpack.distributed.collectives import Collectives
from vacpack.models.activations import ACTIVATIONS
from vacpack.models.base import TensorSource
from vacpack.models.cpu_prepack import (
    LinearKernel,
    PackedWeight,
    kernel_gate,
    meta_like,
    packed_linear,
    prepack,
)
from vacpack.models.lora_layer import LinearLora


@dataclass(frozen=True)
class TensorParallel:
    """Which shard of each layer this process holds, and the collectives of its group."""

    rank: int = 0
    size: int = 1
    # None with one rank, or for a model built only to check that it can be sharded.
    collectives: Collectives | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor parallel rank {self.rank} is outside 0..{self.size - 1}")

    def split(self, num_features: int, what: str) -> int:
        if num_features % self.size:
            raise ValueError(
                f"{what} ({num_features}) is not divisible by tensor_parallel_size {self.size}"
            )
        return num_features // self.size

    def even_rows(self, num_rows: int, what: str) -> RowRange:
        local = self.split(num_rows, what)
        return RowRange(num_rows, self.rank * local, local)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums `tensor` over the ranks in place (nothing with one rank); returns it."""
        if self.size > 1:
            assert self.collectives is not None, "a sharded model runs inside its group"
            self.collectives.all_reduce(tensor)
        return tensor

    def gather_columns(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0: every rank's columns side by side, in rank order. Other ranks: `tensor`."""
        if self.size == 1:
            return tensor
        assert self.collectives is not None, "a sharded model runs inside its group"
        parts = self.collectives.gather(tensor.contiguous())
        return torch.cat(parts, dim=-1) if self.rank == 0 else tensor


SINGLE_RANK = TensorParallel()


@dataclass(frozen=True)
class RowRange:
    """Rows [start, start + length) of a checkpoint tensor of `full_size` rows."""

    full_size: int
    start: int
    length: int


def kv_head_rows(num_kv_heads: int, head_dim: int, tp: TensorParallel) -> RowRange:
    """The key (or value) projection rows one rank holds.

    With at least as many KV heads as ranks, each rank takes an equal share. With fewer, each
    head is replicated on size / num_kv_heads consecutive ranks, as vLLM does: the query heads
    of rank r then use exactly head r // (size / num_kv_heads). Counts that neither divide nor
    are divided by the ranks are refused.
    """
    if num_kv_heads >= tp.size:
        heads = tp.even_rows(num_kv_heads, "key/value heads")
        return RowRange(num_kv_heads * head_dim, heads.start * head_dim, heads.length * head_dim)
    if tp.size % num_kv_heads:
        raise ValueError(
            f"{num_kv_heads} key/value heads can neither be split over nor replicated on "
            f"tensor_parallel_size {tp.size} ranks: choose a size that divides or is a "
            f"multiple of {num_kv_heads}"
        )
    head = tp.rank // (tp.size // num_kv_heads)
    return RowRange(num_kv_heads * head_dim, head * head_dim, head_dim)


# The shard index of a checkpoint tensor that holds all of a merged layer's shards already
# concatenated (Phi-3's qkv_proj and gate_up_proj): each rank takes its slice of every part.
ALL_SHARDS = -1


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's output rows split across ranks; each rank keeps its own slice of y.

    `shard_sizes` lists the full output sizes of the checkpoint tensors merged into this layer
    (for example q, k and v), so one matmul replaces several; `row_ranges` says which rows of
    each this rank keeps (default: an equal share).
    """

    def __init__(
        self,
        input_size: int,
        shard_sizes: list[int],
        bias: bool,
        tp: TensorParallel = SINGLE_RANK,
        row_ranges: list[RowRange] | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.row_ranges = row_ranges or [
            tp.even_rows(size, "output features") for size in shard_sizes
        ]
        output_size = sum(part.length for part in self.row_ranges)
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None
        self.packed_weight: PackedWeight | None = None
        self.lora: LinearLora | None = None  # adapters, where LoRA is enabled (lora_layer.py)

    def checkpoint_shape(self, name: str, shard_index: int = 0) -> tuple[int, ...]:
        """The full shape checkpoint tensor `shard_index` must have: all ranks' rows, of every
        shard for a fused tensor (ALL_SHARDS)."""
        indices = range(len(self.row_ranges)) if shard_index == ALL_SHARDS else [shard_index]
        num_rows = sum(self.row_ranges[i].full_size for i in indices)
        return (num_rows, self.weight.shape[1]) if name == "weight" else (num_rows,)

    def load_shard(self, name: str, source: TensorSource, shard_index: int = 0) -> None:
        """Reads this rank's rows of checkpoint tensor `shard_index` into their place (its
        shape was checked against checkpoint_shape)."""
        param = self.weight if name == "weight" else self.bias
        assert param is not None, f"checkpoint has a {name} this layer does not"
        indices = range(len(self.row_ranges)) if shard_index == ALL_SHARDS else [shard_index]
        source_offset = 0
        for index in indices:
            part = self.row_ranges[index]
            local_offset = sum(p.length for p in self.row_ranges[:index])
            rows = source.read(0, source_offset + part.start, part.length)
            param.data.narrow(0, local_offset, part.length).copy_(rows)
            source_offset += part.full_size

    def prepack_for_cpu(self, kernel: LinearKernel = "onednn") -> None:
        """Call once loading is done: the weight in `kernel`'s layout (cpu_prepack.py)."""
        _prepack_weight(self, kernel)

    def forward(self, x: torch.Tensor, activation: str | None = None) -> torch.Tensor:
        """x W^T + b, then `activation` (a name in activations.ONEDNN_POST_OPS) where given:
        on a prepacked CPU weight, fused into the matmul."""
        if self.lora is not None and self.lora.active:
            y = self.lora.add_to(x, self._linear(x))
            return y if activation is None else ACTIVATIONS[activation](y)
        if self.packed_weight is not None:
            return packed_linear(x, self.packed_weight, self.bias, activation)
        y = F.linear(x, self.weight, self.bias)
        return y if activation is None else ACTIVATIONS[activation](y)

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None:
            return packed_linear(x, self.packed_weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class QKVParallelLinear(ColumnParallelLinear):
    """Query, key and value projections merged into one column-parallel matmul; key and value
    heads are replicated where there are fewer than ranks (kv_head_rows)."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        tp: TensorParallel = SINGLE_RANK,
    ) -> None:
        queries = tp.even_rows(num_heads, "attention heads")
        kv_rows = kv_head_rows(num_kv_heads, head_dim, tp)
        q_rows = RowRange(num_heads * head_dim, queries.start * head_dim, queries.length * head_dim)
        kv_size = num_kv_heads * head_dim
        super().__init__(hidden_size, [num_heads * head_dim, kv_size, kv_size], bias, tp,
                         [q_rows, kv_rows, kv_rows])  # fmt: skip


class GateUpParallelLinear(ColumnParallelLinear):
    """A gated MLP's gate and up projections merged into one column-parallel matmul: each rank
    computes its [gate | up]. Where a C kernel packs it (on a CPU) and applies the
    activation, the kernel also finishes activation(gate) * up as it writes its outputs, and
    the layer returns that, half as wide (`gates_itself`): the [gate | up] product never goes
    to memory, and no separate pass reads it back."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, activation: str, tp: TensorParallel
    ) -> None:
        super().__init__(hidden_size, [intermediate_size, intermediate_size], False, tp)
        self.activation = activation
        self.gate_in_kernel = True

    def kernel_gate(self, kernel: LinearKernel) -> str | None:
        """The activation `kernel` applies to this layer's gate, None where it cannot (or must
        not: LoRA adds its delta to the gate before the activation)."""
        return kernel_gate(kernel, self.activation) if self.gate_in_kernel else None

    def prepack_for_cpu(self, kernel: LinearKernel = "onednn") -> None:
        _prepack_weight(self, kernel, self.kernel_gate(kernel))

    @property
    def gates_itself(self) -> bool:
        """Whether forward returns activation(gate) * up rather than [gate | up]."""
        packed = self.packed_weight
        return isinstance(packed, GemmWeight) and packed.gated_by is not None


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
        self.columns = tp.even_rows(input_size, "input features")
        self.weight = nn.Parameter(
            torch.empty(output_size, self.columns.length), requires_grad=False
        )
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None
        self.packed_weight: PackedWeight | None = None
        self.lora: LinearLora | None = None  # adapters, where LoRA is enabled (lora_layer.py)

    def checkpoint_shape(self, name: str, shard_index: int = 0) -> tuple[int, ...]:
        """The full shape of the checkpoint tensor (all ranks' input columns)."""
        num_outputs = self.weight.shape[0]
        return (num_outputs, self.columns.full_size) if name == "weight" else (num_outputs,)

    def load_shard(self, name: str, source: TensorSource, shard_index: int = 0) -> None:
        if name == "bias":
            assert self.bias is not None, "checkpoint has a bias this layer does not"
            self.bias.data.copy_(source.read())
            return
        self.weight.data.copy_(source.read(1, self.columns.start, self.columns.length))

    def prepack_for_cpu(self, kernel: LinearKernel = "onednn") -> None:
        """Call once loading is done: the weight in `kernel`'s layout (cpu_prepack.py)."""
        _prepack_weight(self, kernel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The bias is added once, after the reduction, not once per rank; on one rank the
        # matmul adds it as it writes its output.
        bias = self.bias if self.tp.size == 1 else None
        if self.packed_weight is not None:
            y = packed_linear(x, self.packed_weight, bias)
        else:
            y = F.linear(x, self.weight, bias)
        if self.lora is not None and self.lora.active:  # a partial sum too, with x's columns
            self.lora.add_to(x, y)
        if self.reduce_results:
            self.tp.all_reduce(y)
        return y if self.bias is None or bias is not None else y + self.bias


class VocabEmbedding(nn.Module):
    """Token embedding table, which may double as the LM head (tied embeddings).

    Split by vocabulary rows: each rank holds ceil(vocab / size) rows (the last rank's tail
    zero-filled), looks up only the tokens in its rows, and the ranks' rows are summed; its
    projection gives logits for its rows, which rank 0 gathers and trims to the vocabulary.
    """

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel = SINGLE_RANK) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.rows_per_rank = -(-vocab_size // tp.size)
        self.first_row = tp.rank * self.rows_per_rank
        self.num_real_rows = max(0, min(self.rows_per_rank, vocab_size - self.first_row))
        self.weight = nn.Parameter(
            torch.empty(self.rows_per_rank, hidden_size), requires_grad=False
        )
        self.packed_weight: PackedWeight | None = None
        # The dtype of the rows it looks up, where the table is stored in another (see
        # store_weights_as); None: the table's.
        self.rows_dtype: torch.dtype | None = None

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the rows `forward` returns: the model's activations'."""
        return self.rows_dtype or self.weight.dtype

    def checkpoint_shape(self, name: str, shard_index: int = 0) -> tuple[int, ...]:
        return (self.vocab_size, self.weight.shape[1])

    def load_shard(self, name: str, source: TensorSource, shard_index: int = 0) -> None:
        if self.num_real_rows < self.rows_per_rank:
            self.weight.data[self.num_real_rows :].zero_()
        if self.num_real_rows:
            rows = source.read(0, self.first_row, self.num_real_rows)
            self.weight.data[: self.num_real_rows].copy_(rows)

    def prepack_for_cpu(self, kernel: LinearKernel = "onednn") -> None:
        """A packed copy for `project`; the plain table stays for the lookups."""
        self.packed_weight = prepack(self.weight, kernel)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(token_ids, self.weight).to(self.dtype)
        local_ids = token_ids - self.first_row
        outside = (local_ids < 0) | (local_ids >= self.num_real_rows)
        rows = F.embedding(local_ids.masked_fill(outside, 0), self.weight).to(self.dtype)
        return self.tp.all_reduce(rows.masked_fill_(outside.unsqueeze(-1), 0.0))

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the vocabulary: hidden @ table^T, in the table's dtype. With several
        ranks, rank 0 gets them all; the others get their own columns (for nothing but the
        gather: their callers drop them)."""
        if self.packed_weight is not None:
            logits = packed_linear(hidden, self.packed_weight, None)
        else:
            logits = F.linear(hidden, self.weight)
        if self.tp.size == 1:
            return logits
        logits = self.tp.gather_columns(logits)
        return logits[..., : self.vocab_size] if self.tp.rank == 0 else logits


class LMHead(VocabEmbedding):
    """An untied LM head: it only projects, so once packed its plain table is dropped."""

    def prepack_for_cpu(self, kernel: LinearKernel = "onednn") -> None:
        super().prepack_for_cpu(kernel)
        if self.packed_weight is not None:
            self.weight = meta_like(self.weight)


def _prepack_weight(
    layer: ColumnParallelLinear | RowParallelLinear,
    kernel: LinearKernel,
    gated_by: str | None = None,
) -> None:
    layer.packed_weight = prepack(layer.weight, kernel, gated_by)
    if layer.packed_weight is not None:
        layer.weight = meta_like(layer.weight)


def store_weights_as(model: nn.Module, weight_dtype: torch.dtype) -> None:
    """Gives `model`'s linear layers and vocabulary tables (still on the meta device) weights of
    `weight_dtype`, the rest of the model keeping its own dtype, that of its activations and
    arithmetic: a bfloat16 checkpoint run in float32 on a CPU without bfloat16 instructions
    keeps its matrices at half the memory (the C kernel widens them as it multiplies; the
    tables' rows are widened as they are looked up), its norms and biases in float32."""
    for layer in model.modules():
        if isinstance(layer, ColumnParallelLinear | RowParallelLinear | VocabEmbedding):
            if isinstance(layer, VocabEmbedding):
                layer.rows_dtype = layer.weight.dtype
            layer.weight = nn.Parameter(
                torch.empty_like(layer.weight, dtype=weight_dtype), requires_grad=False
            )


# Which kernel packs a weight of shape [out_features, in_features]; `vocabulary`: the LM head;
# the last: a gated MLP's gate/up projection's activation, which the C kernel would apply.
LinearKernelFor: TypeAlias = Callable[[int, int, bool, str | None], LinearKernel]


def prepack_linear_weights(
    model: nn.Module, kernel_for: LinearKernelFor | None = None, gate_in_kernel: bool = True
) -> int:
    """Packs `model`'s linear layers and its LM head, if it has one, where they can be (a no-op
    off the CPU), each for the kernel `kernel_for` names (oneDNN where None); returns how many
    were packed. Without `gate_in_kernel` (LoRA) a gated MLP's gate/up layer returns [gate | up]
    for the activation to run after it."""
    layers: list[ColumnParallelLinear | RowParallelLinear | VocabEmbedding] = [
        m for m in model.modules() if isinstance(m, ColumnParallelLinear | RowParallelLinear)
    ]
    for layer in layers:
        if isinstance(layer, GateUpParallelLinear):
            layer.gate_in_kernel = gate_in_kernel
    lm_head = getattr(model, "lm_head", None)
    if isinstance(lm_head, VocabEmbedding):
        layers.append(lm_head)
    for layer in layers:
        out_features, in_features = layer.weight.shape
        vocabulary = isinstance(layer, VocabEmbedding)
        # Timed as the layer runs: gated wherever a C kernel (the float32 one gates the most)
        # could finish its gate.
        gated_by = layer.kernel_gate("c_gemm") if isinstance(layer, GateUpParallelLinear) else None
        kernel = (
            kernel_for(out_features, in_features, vocabulary, gated_by) if kernel_for else "onednn"
        )
        layer.prepack_for_cpu(kernel)
    return sum(layer.packed_weight is not None for layer in layers)
