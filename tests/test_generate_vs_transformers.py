"""Greedy generation and prompt logprobs equal transformers, for every model family."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from vacpack import LLM, SamplingParams

FAMILIES = ["llama", "llama3", "mistral", "qwen2", "qwen3"]
MAX_NEW_TOKENS = 12


def _prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    """18 prompts from 1 to 300 tokens: many page and chunk boundaries."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [1, 2, 3, 5, 7, 16, 17, 31, 40, 64, 65, 90, 128, 150, 199, 230, 270, 300]
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def _transformers_greedy(model_dir, prompts: list[list[int]]) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            generated = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
                max_new_tokens=MAX_NEW_TOKENS,
                do_sample=False,
            )
            outputs.append(generated[0, len(prompt) :].tolist())
    return outputs


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_equal_transformers(family: str, tiny_checkpoint) -> None:
    model_dir = tiny_checkpoint(family)
    # Small pages and a small step budget: prompts are chunked and cross many page boundaries.
    llm = LLM(
        str(model_dir), dtype="float32", block_size=4, max_num_batched_tokens=96, max_num_seqs=8
    )
    prompts = _prompts(llm.loaded.config.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    expected = _transformers_greedy(model_dir, prompts)
    assert ours == expected
    # Chunked prefill and mixed batches really happened.
    steps = llm.engine.timeline.steps
    assert any(0 < s.num_decode_tokens < s.num_tokens for s in steps)


@pytest.mark.parametrize("family", ["llama3", "qwen2"])
def test_prompt_logprobs_close_to_transformers(family: str, tiny_checkpoint) -> None:
    model_dir = tiny_checkpoint(family)
    llm = LLM(str(model_dir), dtype="float32", block_size=8, max_num_batched_tokens=64)
    prompts = _prompts(llm.loaded.config.vocab_size, seed=1)[5:12]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=3)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for prompt, output in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            reference = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
        assert output.prompt_logprobs[0] is None
        assert len(output.prompt_logprobs) == len(prompt)
        for position in range(1, len(prompt)):
            candidates = output.prompt_logprobs[position]
            token = prompt[position]
            expected = reference[position - 1]
            assert candidates[token].logprob == pytest.approx(float(expected[token]), abs=1e-4)
            top3 = expected.topk(3).indices.tolist()
            assert set(top3) <= set(candidates)
            assert candidates[top3[0]].rank == 1


def test_preemption_leaves_greedy_outputs_unchanged(tiny_checkpoint) -> None:
    model_dir = tiny_checkpoint("qwen3")
    common = dict(dtype="float32", block_size=4, max_model_len=320, max_num_batched_tokens=128)
    roomy = LLM(str(model_dir), **common)
    prompts = _prompts(roomy.loaded.config.vocab_size, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    assert roomy.engine.stats.num_preemptions == 0

    # Room for barely more than one full-length sequence: requests must be preempted.
    bytes_per_token = roomy.engine.kv_cache.num_bytes // (roomy.engine.kv_sizing.num_pages * 4)
    tight = LLM(str(model_dir), kv_cache_memory_bytes=400 * bytes_per_token, **common)
    outputs = tight.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert tight.engine.stats.num_preemptions > 0
    assert tight.engine.page_pool.num_free_pages == tight.engine.page_pool.num_pages
