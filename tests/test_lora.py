"""LoRA adapters against transformers + PEFT on tiny random models: the same greedy tokens and
prompt logprobs for each adapter and for the base model, mixed in one batch; adapters cached
apart from the base model in the prefix cache; bad adapters refused with a clear error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lora_adapters import make_adapter
from peft import PeftModel
from transformers_reference import load_reference, random_prompts, transformers_greedy

from vacpack import LLM, BeamSearchParams, SamplingParams
from vacpack.lora import stacking as stacking_choice
from vacpack.lora.request import LoRARequest
from vacpack.tuning.choose import force_env_var

MAX_NEW_TOKENS = 6
LOGPROB_TOLERANCE = 1e-4
ATTENTION_AND_MLP = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Phi-3's checkpoints merge q/k/v and gate/up: its adapters name the merged layers.
TARGETS = {"qwen2": ATTENTION_AND_MLP, "gemma2": ATTENTION_AND_MLP,
           "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]}  # fmt: skip
ENGINE = {"dtype": "float32", "block_size": 8, "max_num_batched_tokens": 48, "enable_lora": True}


def reference_model(base_dir: Path, adapter_dir: Path | None) -> torch.nn.Module:
    model = load_reference(base_dir)
    return model if adapter_dir is None else PeftModel.from_pretrained(model, adapter_dir).eval()


@pytest.mark.parametrize(
    ("family", "stacking"),
    [
        *((family, None) for family in sorted(TARGETS)),  # as measured
        # Every step's adapters each on their own rows, or all stacked (a step's 48 rows at
        # most, under the largest count timed).
        ("qwen2", "gathered"),
        ("qwen2", "stacked"),
    ],
)
def test_adapters_and_the_base_model_in_one_batch_match_peft(
    family: str, stacking: str | None, tiny_checkpoint, tmp_path: Path, monkeypatch
) -> None:
    if stacking is not None:
        monkeypatch.setenv(force_env_var(stacking_choice.PHASE), stacking)
    base_dir = tiny_checkpoint(family)
    adapters = [
        LoRARequest(f"a{index}", index + 1, str(make_adapter(base_dir, tmp_path / f"a{index}",
                    seed=index, targets=TARGETS[family], r=4 * (index + 1), lora_alpha=16)))
        for index in range(2)
    ]  # fmt: skip
    llm = LLM(str(base_dir), **ENGINE)
    assert llm.engine.lora is not None
    if stacking is None:  # timed at the engine's start, and reported with its other choices
        phases = [c.phase for c in llm.engine.setup.measured_choices]
        assert stacking_choice.PHASE in phases
    else:
        forced_rows = 0 if stacking == "gathered" else stacking_choice.ROW_COUNTS[-1]
        assert llm.engine.lora.state.stacked_max_rows == forced_rows
    vocab_size = llm.loaded.config.vocab_size
    # Prompts longer than a step's budget are prefilled in chunks; each prompt runs with each
    # adapter and with none, in one call: the same tokens meet three different models.
    prompts = random_prompts([5, 23, 70], vocab_size, seed=1)
    runs = [(prompt, adapter) for prompt in prompts for adapter in [None, *adapters]]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(
        [prompt for prompt, _ in runs], params, use_tqdm=False,
        lora_request=[adapter for _, adapter in runs],
    )  # fmt: skip
    tokens = {
        (tuple(prompt), adapter and adapter.lora_int_id): output.outputs[0].token_ids
        for (prompt, adapter), output in zip(runs, outputs, strict=True)
    }
    for adapter in [None, *adapters]:
        reference = reference_model(base_dir, adapter and Path(adapter.lora_path))
        expected = transformers_greedy(reference, prompts, MAX_NEW_TOKENS)
        got = [tokens[(tuple(prompt), adapter and adapter.lora_int_id)] for prompt in prompts]
        assert got == expected, f"adapter {adapter}"
    # The adapters change the model: their tokens are not the base model's.
    assert any(tokens[(tuple(p), 1)] != tokens[(tuple(p), None)] for p in prompts)
    # Each output names the adapter it ran, as vLLM's do.
    assert [output.lora_request for output in outputs] == [adapter for _, adapter in runs]


def test_prompt_logprobs_with_an_adapter_match_peft(tiny_checkpoint, tmp_path: Path) -> None:
    base_dir = tiny_checkpoint("qwen2")
    adapter_dir = make_adapter(base_dir, tmp_path / "a", seed=3, targets=ATTENTION_AND_MLP,
                               r=8, lora_alpha=8, use_rslora=True)  # fmt: skip
    adapter = LoRARequest("a", 1, str(adapter_dir))
    llm = LLM(str(base_dir), **ENGINE)
    prompts = random_prompts([12, 40], llm.loaded.config.vocab_size, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=adapter)
    reference = reference_model(base_dir, adapter_dir)
    for prompt, output in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            expected = torch.log_softmax(reference(torch.tensor([prompt])).logits[0].float(), -1)
        for position in range(1, len(prompt)):
            logprob = output.prompt_logprobs[position][prompt[position]].logprob
            assert logprob == pytest.approx(float(expected[position - 1, prompt[position]]),
                                            abs=LOGPROB_TOLERANCE)  # fmt: skip


def test_more_adapters_than_slots_wait_their_turn(tiny_checkpoint, tmp_path: Path) -> None:
    base_dir = tiny_checkpoint("qwen2")
    adapters = [
        LoRARequest(f"a{i}", i + 1, str(make_adapter(base_dir, tmp_path / f"a{i}", seed=10 + i,
                    targets=["q_proj", "v_proj"], r=4, lora_alpha=8)))
        for i in range(3)
    ]  # fmt: skip
    prompts = random_prompts([9, 14, 11], 1000, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    wide = LLM(str(base_dir), **ENGINE)
    expected = wide.generate(prompts, params, use_tqdm=False, lora_request=adapters)
    narrow = LLM(str(base_dir), **{**ENGINE, "max_loras": 1})
    got = narrow.generate(prompts, params, use_tqdm=False, lora_request=adapters)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]


def test_bad_adapters_are_refused_and_the_engine_goes_on(tiny_checkpoint, tmp_path: Path) -> None:
    base_dir = tiny_checkpoint("qwen2")
    good = make_adapter(base_dir, tmp_path / "good", seed=0, targets=["q_proj"], r=4)
    params = SamplingParams(temperature=0.0, max_tokens=2)
    without = LLM(str(base_dir), dtype="float32")
    with pytest.raises(ValueError, match="without enable_lora"):
        without.generate(
            [[1, 2, 3]], params, use_tqdm=False, lora_request=LoRARequest("g", 1, str(good))
        )
    llm = LLM(str(base_dir), **{**ENGINE, "max_lora_rank": 8})
    wide = make_adapter(base_dir, tmp_path / "wide", seed=0, targets=["q_proj"], r=16)
    head = make_adapter(base_dir, tmp_path / "head", seed=0, targets=["lm_head"], r=4)
    other_dir = tiny_checkpoint("qwen2", hidden_size=48)
    mismatched = make_adapter(other_dir, tmp_path / "other", seed=0, targets=["q_proj"], r=4)
    dora = make_adapter(base_dir, tmp_path / "dora", seed=0, targets=["q_proj"], r=4, use_dora=True)
    cases = [
        (LoRARequest("wide", 2, str(wide)), "exceeds max_lora_rank"),
        (LoRARequest("head", 3, str(head)), "not supported"),
        (LoRARequest("other", 4, str(mismatched)), "not the model's"),
        (LoRARequest("dora", 5, str(dora)), "DoRA is not supported"),
        (LoRARequest("missing", 6, str(tmp_path / "nowhere")), "nowhere"),
        (LoRARequest("good", 1, str(good)), None),
        (LoRARequest("reused", 1, str(wide)), "give each adapter its own id"),
    ]
    for adapter, message in cases:
        if message is None:
            assert llm.generate([[1, 2, 3]], params, use_tqdm=False, lora_request=adapter)
            continue
        with pytest.raises(Exception, match=message):
            llm.generate([[1, 2, 3]], params, use_tqdm=False, lora_request=adapter)
    # Nothing half-loaded: the refused adapters left no weights behind.
    assert set(llm.engine.lora.adapters) == {1}
    assert all(set(layer.weights) <= {1} for layer in llm.engine.lora.layers.values())
    config = json.loads((good / "adapter_config.json").read_text())
    assert config["r"] == 4


def test_beam_search_with_an_adapter_equals_the_search_on_peft(
    tiny_checkpoint, tmp_path: Path
) -> None:
    from test_beam_search import MIN_DECISION_GAP, reference_beam_search

    base_dir = tiny_checkpoint("qwen2")
    adapter_dir = make_adapter(base_dir, tmp_path / "a", seed=6, targets=ATTENTION_AND_MLP, r=8)
    llm = LLM(str(base_dir), **ENGINE)
    reference = reference_model(base_dir, adapter_dir)
    prompts = random_prompts([6, 11, 17, 9], llm.loaded.config.vocab_size, seed=5)
    params = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
    adapter = LoRARequest("a", 1, str(adapter_dir))
    outputs = llm.beam_search(prompts, params, lora_request=adapter)
    compared = 0
    for prompt, output in zip(prompts, outputs, strict=True):
        expected, gap = reference_beam_search(reference, prompt, 2, 4, frozenset())
        if gap < MIN_DECISION_GAP:
            continue
        compared += 1
        assert [s.tokens for s in output.sequences] == [tokens for tokens, _ in expected]
    assert compared >= 2, "too few prompts without near ties to compare"


@pytest.mark.parametrize(
    "engine_args",
    [
        {"async_scheduling": True},
        {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                "prompt_lookup_min": 1}},
    ],
    ids=["async_scheduling", "speculative_decoding"],
)  # fmt: skip
def test_adapters_under_async_scheduling_and_speculation_give_the_same_tokens(
    engine_args: dict, tiny_checkpoint, tmp_path: Path
) -> None:
    base_dir = tiny_checkpoint("qwen2")
    adapter_dir = make_adapter(base_dir, tmp_path / "a", seed=7, targets=ATTENTION_AND_MLP, r=4)
    adapter = LoRARequest("a", 1, str(adapter_dir))
    plain = LLM(str(base_dir), **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    first = random_prompts([7, 12], plain.loaded.config.vocab_size, seed=8)
    # Each prompt repeats what the adapted model wrote after its first part: the n-gram lookup
    # then drafts from it.
    written = plain.generate(first, params, use_tqdm=False, lora_request=adapter)
    prompts = [p + w.outputs[0].token_ids + p for p, w in zip(first, written, strict=True)]
    assigned = [adapter, None]
    expected = plain.generate(prompts, params, use_tqdm=False, lora_request=assigned)
    other = LLM(str(base_dir), **ENGINE, **engine_args)
    got = other.generate(prompts, params, use_tqdm=False, lora_request=assigned)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    if "speculative_config" in engine_args:
        assert other.engine.state().num_draft_tokens > 0
