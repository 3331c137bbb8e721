"""PEFT LoRA adapters with random weights for tiny test models."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers_reference import load_reference


def make_adapter(
    base_dir: Path, out_dir: Path, seed: int, targets: list[str], **lora_settings
) -> Path:
    """A PEFT adapter with random A and B (PEFT's default leaves B zero: no change at all)."""
    torch.manual_seed(seed)
    config = LoraConfig(target_modules=targets, init_lora_weights=False, **lora_settings)
    peft_model = get_peft_model(load_reference(base_dir), config)
    with torch.no_grad():  # small deltas: they change some tokens, not every one
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.mul_(0.2)
    peft_model.save_pretrained(out_dir)
    return out_dir
