"""What transformers computes for a checkpoint: the reference our model families are held to."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from vacpack import LLM, SamplingParams


def load_reference(model_dir: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def random_prompts(lengths: list[int], vocab_size: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lengths]


@torch.no_grad()
def transformers_greedy(
    model: PreTrainedModel, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    outputs = []
    for prompt in prompts:
        generated = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
        )
        outputs.append(generated[0, len(prompt) :].tolist())
    return outputs


def ours_greedy(llm: LLM, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@torch.no_grad()
def assert_prompt_logprobs_match(
    llm: LLM, model: PreTrainedModel, prompts: list[list[int]], tolerance: float = 1e-4
) -> None:
    """Every prompt token's logprob within `tolerance` of transformers', and the same top 1."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        reference = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
        assert len(output.prompt_logprobs) == len(prompt)
        for position in range(1, len(prompt)):
            candidates = output.prompt_logprobs[position]
            token, expected = prompt[position], reference[position - 1]
            assert candidates[token].logprob == pytest.approx(float(expected[token]), abs=tolerance)
            assert candidates[int(expected.argmax())].rank == 1
