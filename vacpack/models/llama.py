"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3) over a packed 1-D token stream.

There is no batch axis: a step's sequences are concatenated, positions restart at 0 for each
sequence, and the attention backend keeps sequences apart. The LM head runs only on the rows
whose logits are needed.

The other decoder families (Gemma, Phi-3, the mixtures of experts) are this model with a
different layer, norm or MLP: they override `make_layer` and the checkpoint name mapping.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from vacpack.models.activations import ACTIVATIONS, act_and_mul
from vacpack.models.base import PackedModel
from vacpack.models.forward_context import ForwardContext
from vacpack.models.layer_ops import DECODER_LAYER_OPS, current_layer_ops
from vacpack.models.model_config import ModelConfig
from vacpack.models.norm import RMSNorm
from vacpack.models.parallel import (
    SINGLE_RANK,
    GateUpParallelLinear,
    LMHead,
    QKVParallelLinear,
    RowParallelLinear,
    TensorParallel,
    VocabEmbedding,
    kv_head_rows,
)
from vacpack.models.rotary import RotaryEmbedding


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_index: int,
        tp: TensorParallel,
        norm_class: type[RMSNorm] = RMSNorm,
    ) -> None:
        super().__init__()
        ops = current_layer_ops()
        # The fused rotary kernel rotates whole heads; a partial rotary runs PyTorch's ops.
        self.rotary_ops = ops if config.partial_rotary_factor == 1.0 else ops.portable()
        self.layer_index = layer_index
        self.spec = config.attention_spec(layer_index)
        self.num_heads = tp.split(config.num_heads, "attention heads")
        self.num_kv_heads = kv_head_rows(config.num_kv_heads, 1, tp).length
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            config.head_dim,
            config.num_heads,
            config.num_kv_heads,
            bias=config.attention_bias,
            tp=tp,
        )
        self.o_proj = RowParallelLinear(
            config.num_heads * config.head_dim, config.hidden_size, bias=False, tp=tp
        )
        self.q_norm = norm_class(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = norm_class(config.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        hidden: torch.Tensor,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_ops.rotary_qk(q, k, cos_sin)
        kv_layer = ctx.kv_layer(self.layer_index)
        out = ctx.attention.forward(q, k, v, kv_layer, ctx.metadata, self.spec)
        return self.o_proj(out.view(num_tokens, q_size))


class LlamaMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up in one matmul. `intermediate_size` overrides the
    config's (a mixture's experts are narrower); without `reduce_results` the tensor-parallel
    partial sums are left for the caller to reduce once (a mixture sums its experts first)."""

    def __init__(
        self,
        config: ModelConfig,
        tp: TensorParallel,
        intermediate_size: int | None = None,
        reduce_results: bool = True,
    ) -> None:
        super().__init__()
        self.ops = current_layer_ops()
        if config.hidden_act not in ACTIVATIONS:
            raise ValueError(
                f"hidden_act {config.hidden_act!r} is not supported ({', '.join(ACTIVATIONS)})"
            )
        self.hidden_act = config.hidden_act
        self.is_silu = config.hidden_act == "silu"
        size = intermediate_size or config.intermediate_size
        self.gate_up_proj = GateUpParallelLinear(config.hidden_size, size, config.hidden_act, tp)
        self.down_proj = RowParallelLinear(
            size, config.hidden_size, bias=False, tp=tp, reduce_results=reduce_results
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = self.ops.mlp_rows_per_pass  # a CPU's caches hold a slice of rows, not all
        # LoRA's rows are those of the whole step: its MLPs take them in one pass.
        lora = self.gate_up_proj.lora
        if rows is None or hidden.shape[0] <= rows or (lora is not None and lora.active):
            return self._mlp(hidden)
        return torch.cat([self._mlp(part) for part in hidden.split(rows)])

    def _mlp(self, hidden: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(hidden)
        if self.gate_up_proj.gates_itself:  # already act(gate) * up
            return self.down_proj(gate_up)
        if self.is_silu:
            return self.down_proj(self.ops.silu_and_mul(gate_up))
        return self.down_proj(act_and_mul(gate_up, self.hidden_act))


def with_kept_rows(
    layers: nn.ModuleList, ctx: ForwardContext
) -> list[tuple[nn.Module, torch.Tensor | None]]:
    """Each layer with the rows it passes on past its attention: every row (None), and at the
    last layer ctx.output_rows (see select_rows)."""
    last = len(layers) - 1
    return [(layer, ctx.output_rows if i == last else None) for i, layer in enumerate(layers)]


def select_rows(
    rows: torch.Tensor | None, hidden: torch.Tensor, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The given rows of a layer's hidden states and residual stream (all of them for None).

    Every row's keys and values are written and read by attention; past the last layer's
    attention a row meets no other, so the rows whose outputs nobody reads can stop there. In a
    generation step that is every prompt row but the last of each prompt: a prefill skips the
    last layer's MLP for nearly all its tokens (close to 1/num_layers of its linears' work)."""
    if rows is None:
        return hidden, residual
    return hidden.index_select(0, rows), residual.index_select(0, rows)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_index: int,
        tp: TensorParallel,
        mlp: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_index, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp if mlp is not None else LlamaMLP(config, tp)

    def forward(
        self,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: ForwardContext,
        keep_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """keep_rows (the last layer's): past attention only these rows go on."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.self_attn(cos_sin, hidden, ctx)
        hidden, residual = select_rows(keep_rows, hidden, residual)
        hidden, residual = self.post_attention_layernorm.add_and_norm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(PackedModel):
    config_class: ClassVar[Any] = ModelConfig
    is_decoder = True
    layer_ops_used = DECODER_LAYER_OPS
    decoder_layers = True
    prunes_output_rows = True
    # Checkpoint names that feed one of our merged layers: (our name, shard index).
    MERGED_WEIGHTS: ClassVar[dict[str, tuple[str, int]]] = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    norm_class: ClassVar[type[RMSNorm]] = RMSNorm

    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE_RANK) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            self.make_layer(config, i, tp) for i in range(config.num_layers)
        )
        self.norm = self.norm_class(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (
            self.embed_tokens
            if config.tie_word_embeddings
            else LMHead(config.vocab_size, config.hidden_size, tp)
        )
        self.rotary = RotaryEmbedding(config.rope)

    def make_layer(self, config: ModelConfig, layer_index: int, tp: TensorParallel) -> nn.Module:
        return LlamaDecoderLayer(config, layer_index, tp)

    def rotary_embeddings(self) -> list[RotaryEmbedding]:
        return [self.rotary]

    def checkpoint_name(self, hf_name: str) -> tuple[str, int] | None:
        """Maps a checkpoint tensor name to (our parameter name, shard index); None to skip it."""
        name = hf_name.removeprefix("model.")
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None
        if "rotary_emb" in name:
            return None
        for hf_part, (ours, shard_index) in self.MERGED_WEIGHTS.items():
            if f".{hf_part}." in name:
                return name.replace(hf_part, ours), shard_index
        return name, 0

    def finish_loading(self) -> None:
        device = self.embed_tokens.weight.device
        for rotary in self.rotary_embeddings():
            rotary.build_cache(device, self.embed_tokens.dtype)

    def limit_context(self, max_model_len: int) -> None:
        """The engine runs sequences of at most max_model_len tokens: the rotary tables cover
        that many positions, and longrope picks its factors by it."""
        for rotary in self.rotary_embeddings():
            rotary.build_cache(rotary.cos_sin.device, rotary.cos_sin.dtype, max_model_len)

    def forward(
        self, token_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """Returns the final hidden states, one row per token of the packed stream (or per row
        of ctx.output_rows)."""
        cos_sin = self.rotary.cos_sin_for(positions)
        hidden = self.embed_tokens(token_ids)
        residual = None
        for layer, keep_rows in with_kept_rows(self.layers, ctx):
            hidden, residual = layer(cos_sin, hidden, residual, ctx, keep_rows)
        assert residual is not None, "a model has at least one layer"
        hidden, _ = self.norm.add_and_norm(hidden, residual)
        return hidden

    def compute_logits(
        self, hidden: torch.Tensor, dtype: torch.dtype | None = torch.float32
    ) -> torch.Tensor:
        """Logits for the given rows only: float32 by default, or the model's dtype for None
        (as the reference computes them; a scorer that converts small slices itself saves
        writing and re-reading a float32 copy of [rows, vocab]). With tensor parallelism every
        rank calls it and rank 0 gets the logits (VocabEmbedding.project)."""
        logits = self.lm_head.project(hidden)
        return logits if dtype is None else logits.to(dtype)
