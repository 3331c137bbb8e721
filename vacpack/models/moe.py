"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE and Qwen3-MoE.

Llama's layers with the MLP replaced, in the layers the config names, by a sparse block: a
router picks each token's top-k experts (softmax over all experts, then the k largest, whose
weights are renormalised to sum to 1 where the config says so) and the token's output is the
weighted sum of those experts' MLPs. Qwen2-MoE adds a shared expert that every token runs,
scaled by a sigmoid gate of its own.

The packed tokens are sorted by expert, so each expert runs one matmul over all of its tokens
(a loop over the experts that received any, never over tokens); the weighted outputs are then
added back to their tokens in expert order, as the reference does. With tensor parallelism the
experts' intermediate features are split across ranks like a dense MLP's, and the block's
output is all-reduced once, after every expert's partial sum is in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vacpack.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from vacpack.models.model_config import ModelConfig, decoder_fields
from vacpack.models.parallel import TensorParallel

# Mixtral's checkpoint names for its block and expert weights -> ours (Qwen's already match).
MIXTRAL_NAMES = {
    ".block_sparse_moe.": ".mlp.",
    ".w1.": ".gate_proj.",
    ".w3.": ".up_proj.",
    ".w2.": ".down_proj.",
}


@dataclass(frozen=True)
class MoeConfig(ModelConfig):
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int  # each expert's
    norm_topk_prob: bool  # renormalise the top-k weights to sum to 1
    # Mixtral keeps the renormalised weights in float32; Qwen rounds them to the model's dtype.
    router_weights_in_float32: bool
    shared_expert_intermediate_size: int  # 0: no shared expert
    sparse_layers: tuple[bool, ...]  # per layer: a sparse block, or a dense MLP

    @classmethod
    def from_hf(cls, hf_config: Any) -> MoeConfig:
        fields = decoder_fields(hf_config)
        num_layers = fields["num_layers"]
        if hf_config.model_type == "mixtral":
            return cls(
                **fields,
                num_experts=hf_config.num_local_experts,
                num_experts_per_tok=hf_config.num_experts_per_tok,
                moe_intermediate_size=hf_config.intermediate_size,
                norm_topk_prob=True,
                router_weights_in_float32=True,
                shared_expert_intermediate_size=0,
                sparse_layers=(True,) * num_layers,
            )
        dense_layers = set(getattr(hf_config, "mlp_only_layers", None) or ())
        step = getattr(hf_config, "decoder_sparse_step", 1) or 1
        return cls(
            **fields,
            num_experts=hf_config.num_experts,
            num_experts_per_tok=hf_config.num_experts_per_tok,
            moe_intermediate_size=hf_config.moe_intermediate_size,
            norm_topk_prob=bool(hf_config.norm_topk_prob),
            router_weights_in_float32=False,
            shared_expert_intermediate_size=getattr(
                hf_config, "shared_expert_intermediate_size", 0
            ),
            sparse_layers=tuple(
                i not in dense_layers and hf_config.num_experts > 0 and (i + 1) % step == 0
                for i in range(num_layers)
            ),
        )


class SparseMoeBlock(nn.Module):
    def __init__(self, config: MoeConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.router_weights_in_float32 = config.router_weights_in_float32
        # The router is tiny and every rank needs all of its logits: replicated, not sharded.
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.gate.requires_grad_(False)
        self.experts = nn.ModuleList(
            LlamaMLP(config, tp, config.moe_intermediate_size, reduce_results=False)
            for _ in range(config.num_experts)
        )
        self.shared_expert = self.shared_expert_gate = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = LlamaMLP(
                config, tp, config.shared_expert_intermediate_size, reduce_results=False
            )
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
            self.shared_expert_gate.requires_grad_(False)

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, expert ids), each [num_tokens, top_k]."""
        router_logits = self.gate(hidden)
        probs = torch.softmax(router_logits.float(), dim=-1)
        weights, expert_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.router_weights_in_float32:
            weights = weights.to(router_logits.dtype)
        return weights, expert_ids

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = self.route(hidden)
        out = self.run_experts(hidden, weights, expert_ids)
        if self.shared_expert is not None:
            assert self.shared_expert_gate is not None  # built together
            gate = torch.sigmoid(self.shared_expert_gate(hidden))
            out = out + gate * self.shared_expert(hidden)
        return self.tp.all_reduce(out)

    def run_experts(
        self, hidden: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor
    ) -> torch.Tensor:
        """Sum over each token's experts of weight * expert(token), one matmul per expert."""
        flat_ids = expert_ids.flatten()
        # Stable, so that each expert's tokens keep stream order and a token's contributions
        # are added in expert order.
        order = torch.argsort(flat_ids, stable=True)
        tokens = order // self.top_k
        counts = torch.bincount(flat_ids, minlength=len(self.experts)).tolist()
        grouped = hidden.index_select(0, tokens)
        expert_out = torch.empty_like(grouped)
        start = 0
        for expert, count in zip(self.experts, counts, strict=True):
            if count:
                expert_out[start : start + count] = expert(grouped[start : start + count])
                start += count
        weighted = (expert_out * weights.flatten()[order].unsqueeze(1)).to(hidden.dtype)
        return torch.zeros_like(hidden).index_add_(0, tokens, weighted)


class MoeForCausalLM(LlamaForCausalLM):
    config_class = MoeConfig

    def make_layer(self, config: ModelConfig, layer_index: int, tp: TensorParallel) -> nn.Module:
        assert isinstance(config, MoeConfig)
        mlp = None
        if config.sparse_layers[layer_index]:
            mlp = SparseMoeBlock(config, tp)
        return LlamaDecoderLayer(config, layer_index, tp, mlp=mlp)

    def checkpoint_name(self, hf_name: str) -> tuple[str, int] | None:
        if self.config.architecture == "MixtralForCausalLM":
            for theirs, ours in MIXTRAL_NAMES.items():
                hf_name = hf_name.replace(theirs, ours)
        return super().checkpoint_name(hf_name)
