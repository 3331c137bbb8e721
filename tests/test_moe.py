"""Mixture-of-experts blocks: tokens grouped per expert equal a token-by-token reference, and a
model whose router leaves most experts idle still equals transformers."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers_reference import load_reference, ours_greedy, random_prompts, transformers_greedy

from vacpack import LLM
from vacpack.models.moe import SparseMoeBlock
from vacpack.testing.packed_forward import load_for_test


def _token_by_token(
    block: SparseMoeBlock, hidden: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor
) -> torch.Tensor:
    out = torch.zeros_like(hidden)
    for token in range(hidden.shape[0]):
        for weight, expert in zip(weights[token], expert_ids[token], strict=True):
            out[token] += weight * block.experts[int(expert)](hidden[token : token + 1])[0]
    return out


def test_grouped_experts_equal_a_token_by_token_loop(tiny_checkpoint) -> None:
    model = load_for_test(tiny_checkpoint("qwen3_moe"))
    block = model.layers[0].mlp
    assert isinstance(block, SparseMoeBlock) and len(block.experts) == 8
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(40, model.config.hidden_size, generator=generator)
    with torch.inference_mode():
        weights, expert_ids = block.route(hidden)
        torch.testing.assert_close(
            block.run_experts(hidden, weights, expert_ids),
            _token_by_token(block, hidden, weights, expert_ids),
        )
        # Skewed: every token to experts 5 and 2 (in that order), the other six get nothing.
        skewed_ids = torch.tensor([[5, 2]]).expand(40, 2)
        torch.testing.assert_close(
            block.run_experts(hidden, weights, skewed_ids),
            _token_by_token(block, hidden, weights, skewed_ids),
        )


def _skewed_checkpoint(source: Path, out_dir: Path) -> Path:
    """The router of layer 0 scores experts 2-7 at exactly 0 for every token, so each token goes
    to expert 0 or 1 where their scores are positive, else to whichever of the tied 2-7 topk
    picks; those six share one set of weights, so the tie-break cannot change the output."""
    shutil.copytree(source, out_dir)
    (weights_file,) = out_dir.glob("*.safetensors")
    tensors = load_file(weights_file)
    tensors["model.layers.0.mlp.gate.weight"][2:] = 0.0
    for expert in range(3, 8):
        for part in ("gate_proj", "up_proj", "down_proj"):
            prefix = "model.layers.0.mlp.experts"
            tensors[f"{prefix}.{expert}.{part}.weight"] = tensors[
                f"{prefix}.2.{part}.weight"
            ].clone()
    save_file(tensors, weights_file, metadata={"format": "pt"})
    return out_dir


def test_skewed_routing_equals_transformers(
    tiny_checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = _skewed_checkpoint(tiny_checkpoint("qwen3_moe"), tmp_path / "skewed")
    counts_per_call: list[list[int]] = []
    route = SparseMoeBlock.route

    def recording_route(block: SparseMoeBlock, hidden: torch.Tensor):
        weights, expert_ids = route(block, hidden)
        counts_per_call.append(torch.bincount(expert_ids.flatten(), minlength=8).tolist())
        return weights, expert_ids

    monkeypatch.setattr(SparseMoeBlock, "route", recording_route)
    llm = LLM(str(model_dir), dtype="float32", block_size=4, max_num_batched_tokens=32)
    prompts = random_prompts([12, 30, 57], llm.loaded.config.vocab_size, seed=2)
    ours = ours_greedy(llm, prompts, 8)
    assert ours == transformers_greedy(load_reference(model_dir), prompts, 8)
    prefills = [counts for counts in counts_per_call if sum(counts) >= 32]
    assert prefills, "no step routed 16 tokens or more"
    for counts in prefills:
        assert counts.count(0) >= 4  # most experts idle
        assert max(counts) >= sum(counts) // 4  # and a few busy
