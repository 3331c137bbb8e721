"""The BERT encoder family over a packed 1-D token stream.

There is no batch axis and no padding: a step's sequences are concatenated, positions restart at
0 for each sequence, and the attention backend, given a layout with `causal=False`, lets every
token see its whole sequence and nothing beyond it. `BertModel` is the bare encoder (the body of
sentence-transformers embedding checkpoints such as all-MiniLM-L6-v2); the sequence classifier
adds the pooler and the classifier on each sequence's first ([CLS]) token.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar

import torch
from torch import nn

from vacpack.models.activations import ACTIVATIONS, ONEDNN_POST_OPS
from vacpack.models.base import PackedModel
from vacpack.models.forward_context import ForwardContext
from vacpack.models.labels import id2label_from_hf, num_labels_from_hf
from vacpack.models.layer_ops import ENCODER_LAYER_OPS
from vacpack.models.norm import AddLayerNorm
from vacpack.models.parallel import (
    SINGLE_RANK,
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    TensorParallel,
    VocabEmbedding,
)
from vacpack.models.pooling import PoolingConfig, pool


@dataclass(frozen=True)
class EncoderConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int  # the longest sequence the model reads
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    num_labels: int  # 0 for a bare encoder, which has no classification head
    id2label: dict[int, str]
    # RoBERTa-family position ids start after the padding row (padding_idx + 1); BERT's at 0.
    position_offset: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_hf(cls, hf_config: Any) -> EncoderConfig:
        architectures = getattr(hf_config, "architectures", None) or []
        if not architectures:
            raise ValueError("config.json names no architectures; cannot pick a model class")
        architecture = architectures[0]
        # transformers 5 dropped relative position embeddings from BERT; older configs may still
        # name them, and reading such a checkpoint with absolute positions would be silently wrong.
        position_type = getattr(hf_config, "position_embedding_type", None) or "absolute"
        if position_type != "absolute":
            raise ValueError(f"position_embedding_type {position_type!r} is not supported")
        hidden_act = getattr(hf_config, "hidden_act", "gelu")
        if hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {hidden_act!r} is not supported: {sorted(ACTIVATIONS)}")
        if hf_config.hidden_size % hf_config.num_attention_heads:
            raise ValueError("hidden_size is not a multiple of num_attention_heads")
        num_labels = (
            num_labels_from_hf(hf_config)
            if architecture.endswith("ForSequenceClassification")
            else 0
        )
        return cls(
            architecture=architecture,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=hf_config.num_attention_heads,
            intermediate_size=hf_config.intermediate_size,
            max_position_embeddings=hf_config.max_position_embeddings,
            type_vocab_size=getattr(hf_config, "type_vocab_size", 2),
            layer_norm_eps=getattr(hf_config, "layer_norm_eps", 1e-12),
            hidden_act=hidden_act,
            num_labels=num_labels,
            id2label=id2label_from_hf(hf_config, num_labels),
        )


class EncoderEmbeddings(nn.Module):
    def __init__(self, config: EncoderConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.word_embeddings = VocabEmbedding(config.vocab_size, config.hidden_size, tp)
        self.position_embeddings = nn.Embedding(
            config.max_position_embeddings + config.position_offset, config.hidden_size
        )
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.norm = AddLayerNorm(config.hidden_size, config.layer_norm_eps)

    def forward(
        self,
        token_ids: torch.Tensor,
        position_ids: torch.Tensor,
        token_type_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        """`position_ids` index the position table (offset included); token types default to 0."""
        if token_type_ids is None:
            # Single-segment inputs: one type row broadcast over the stream.
            type_rows = self.token_type_embeddings.weight[0]
        else:
            type_rows = self.token_type_embeddings(token_type_ids)
        # Types are added before positions, in the reference's order.
        hidden = self.word_embeddings(token_ids) + type_rows
        return self.norm(hidden, self.position_embeddings(position_ids))


class EncoderAttention(nn.Module):
    def __init__(self, config: EncoderConfig, layer_index: int, tp: TensorParallel) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = tp.split(config.num_heads, "attention heads")
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            config.head_dim,
            config.num_heads,
            config.num_heads,
            bias=True,
            tp=tp,
        )
        self.o_proj = RowParallelLinear(config.hidden_size, config.hidden_size, bias=True, tp=tp)

    def forward(self, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        # The merged projection's output is [q heads | k heads | v heads].
        qkv = self.qkv_proj(hidden).view(num_tokens, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.unbind(1)
        out = ctx.attention.forward(q, k, v, ctx.kv_layer(self.layer_index), ctx.metadata)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class EncoderMLP(nn.Module):
    def __init__(self, config: EncoderConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.hidden_act = config.hidden_act
        self.up_proj = ColumnParallelLinear(
            config.hidden_size, [config.intermediate_size], bias=True, tp=tp
        )
        self.down_proj = RowParallelLinear(
            config.intermediate_size, config.hidden_size, bias=True, tp=tp
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.hidden_act in ONEDNN_POST_OPS:
            # On a prepacked CPU weight the activation is fused into the matmul.
            return self.down_proj(self.up_proj(hidden, activation=self.hidden_act))
        return self.down_proj(ACTIVATIONS[self.hidden_act](self.up_proj(hidden)))


class EncoderLayer(nn.Module):
    """A post-norm block: each sub-layer's output is added to its input, then normalised."""

    def __init__(self, config: EncoderConfig, layer_index: int, tp: TensorParallel) -> None:
        super().__init__()
        self.attention = EncoderAttention(config, layer_index, tp)
        self.attention_norm = AddLayerNorm(config.hidden_size, config.layer_norm_eps)
        self.mlp = EncoderMLP(config, tp)
        self.mlp_norm = AddLayerNorm(config.hidden_size, config.layer_norm_eps)

    def forward(self, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        hidden = self.attention_norm(self.attention(hidden, ctx), hidden)
        return self.mlp_norm(self.mlp(hidden), hidden)


# Inside "encoder.layer.N.": checkpoint name prefix -> (our prefix, shard index). The attention
# entries come first because "attention.output.dense." also ends in "output.dense.".
_LAYER_WEIGHTS: tuple[tuple[str, str, int], ...] = (
    ("attention.self.query.", "attention.qkv_proj.", 0),
    ("attention.self.key.", "attention.qkv_proj.", 1),
    ("attention.self.value.", "attention.qkv_proj.", 2),
    ("attention.output.dense.", "attention.o_proj.", 0),
    ("attention.output.LayerNorm.", "attention_norm.", 0),
    ("intermediate.dense.", "mlp.up_proj.", 0),
    ("output.dense.", "mlp.down_proj.", 0),
    ("output.LayerNorm.", "mlp_norm.", 0),
)
_LAYER_NAME = re.compile(r"encoder\.layer\.(\d+)\.(.+)")
_EMBEDDING_WEIGHTS = frozenset(
    {
        "embeddings.word_embeddings.weight",
        "embeddings.position_embeddings.weight",
        "embeddings.token_type_embeddings.weight",
    }
)
# Checkpoints converted from TensorFlow name LayerNorm parameters gamma and beta.
_LAYER_NORM_RENAMES: Mapping[str, str] = MappingProxyType({"gamma": "weight", "beta": "bias"})


class BertModel(PackedModel):
    """The bare encoder: final hidden states, for embeddings pooled outside the model."""

    config_class = EncoderConfig
    is_decoder = False
    layer_ops_used = ENCODER_LAYER_OPS
    # Encoders attend in both directions: run them with BatchLayout(..., causal=False).
    is_causal = False
    # Task checkpoints put the encoder under this prefix; bare ones have none.
    CHECKPOINT_PREFIX: ClassVar[str] = "bert."
    # Head tensors this class keeps: checkpoint name prefix -> our module prefix.
    HEAD_WEIGHTS: ClassVar[tuple[tuple[str, str], ...]] = ()

    def __init__(self, config: EncoderConfig, tp: TensorParallel = SINGLE_RANK) -> None:
        super().__init__()
        self.config = config
        self.embeddings = EncoderEmbeddings(config, tp)
        self.layers = nn.ModuleList(EncoderLayer(config, i, tp) for i in range(config.num_layers))

    def checkpoint_name(self, hf_name: str) -> tuple[str, int] | None:
        """Maps a checkpoint tensor name to (our parameter name, shard index); None to skip it.

        Bare sentence-transformers checkpoints have no prefix; task checkpoints put the encoder
        under CHECKPOINT_PREFIX. Buffers (position_ids) and heads this class lacks are skipped.
        """
        name = hf_name.removeprefix(self.CHECKPOINT_PREFIX)
        prefix, _, param = name.rpartition(".")
        param = _LAYER_NORM_RENAMES.get(param, param) if prefix.endswith("LayerNorm") else param
        name = f"{prefix}.{param}"
        if name in _EMBEDDING_WEIGHTS:
            return name, 0
        if prefix == "embeddings.LayerNorm":
            return f"embeddings.norm.{param}", 0
        layer = _LAYER_NAME.fullmatch(name)
        if layer is not None:
            index, rest = layer.groups()
            for hf_part, ours, shard_index in _LAYER_WEIGHTS:
                if rest.startswith(hf_part):
                    return f"layers.{index}.{ours}{rest.removeprefix(hf_part)}", shard_index
            return None
        for hf_prefix, our_prefix in self.HEAD_WEIGHTS:
            if name.startswith(hf_prefix):
                return our_prefix + name.removeprefix(hf_prefix), 0
        return None

    def finish_loading(self) -> None:
        # nn.Embedding, nn.LayerNorm and nn.Linear default to trainable parameters; nothing here
        # is trained, and a forward outside inference_mode must not build an autograd graph.
        self.requires_grad_(False)

    def position_ids(self, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rows of the position table for the packed stream's positions (restarting at 0)."""
        return positions

    def forward(
        self, token_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """Returns the final hidden states, one row per token of the packed stream."""
        position_ids = self.position_ids(token_ids, positions)
        hidden = self.embeddings(token_ids, position_ids, ctx.token_type_ids)
        for layer in self.layers:
            hidden = layer(hidden, ctx)
        return hidden


_FIRST_TOKEN = PoolingConfig("cls", normalize=False)


class BertForSequenceClassification(BertModel):
    """The encoder plus BERT's pooler (dense + tanh on [CLS]) and a linear classifier."""

    HEAD_WEIGHTS: ClassVar[tuple[tuple[str, str], ...]] = (
        ("pooler.dense.", "pooler."),
        ("classifier.", "classifier."),
    )

    def __init__(self, config: EncoderConfig, tp: TensorParallel = SINGLE_RANK) -> None:
        super().__init__(config, tp)
        self.pooler = nn.Linear(config.hidden_size, config.hidden_size)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    def classify(self, hidden: torch.Tensor, seq_lens: Sequence[int]) -> torch.Tensor:
        """[num_tokens, hidden] from forward -> float32 logits [num_seqs, num_labels]."""
        first_rows = pool(hidden, seq_lens, _FIRST_TOKEN).to(hidden.dtype)
        return self.classifier(torch.tanh(self.pooler(first_rows))).float()
