"""vLLM's LLMEngine surface: EngineArgs, from_engine_args, add_request with every prompt form,
a caller-driven step loop with streamed outputs, aborting, and `LLM.llm_engine`."""

from __future__ import annotations

import itertools

import pytest

from vacpack import LLM, EngineArgs, LLMEngine, SamplingParams, TextPrompt, TokensPrompt
from vacpack.outputs import RequestOutput

PROMPTS = ["The weather today is", "A long time ago", "In the beginning"]
ENGINE_KWARGS = {"dtype": "float32", "block_size": 8, "max_num_batched_tokens": 128}


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("qwen2"))


@pytest.fixture(scope="module")
def engine(checkpoint: str) -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs(model=checkpoint, **ENGINE_KWARGS))


def _run_to_end(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    """Every output each request returned, step by step, as vLLM's example loop collects them."""
    outputs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append(output)
    return outputs


def test_a_step_loop_gives_what_llm_generate_gives(engine: LLMEngine, checkpoint: str) -> None:
    params = SamplingParams(temperature=0, max_tokens=6)
    tokenizer = engine.get_tokenizer()
    forms = [
        PROMPTS[0],
        TextPrompt(prompt=PROMPTS[1]),
        TokensPrompt(prompt_token_ids=tokenizer.encode(PROMPTS[2])),
        tokenizer.encode(PROMPTS[0]),  # bare token ids
    ]
    for index, prompt in enumerate(forms):
        engine.add_request(str(index), prompt, params)
    assert engine.get_num_unfinished_requests() == len(forms)
    outputs = _run_to_end(engine)
    with LLM(checkpoint, **ENGINE_KWARGS) as llm:
        expected = llm.generate([*PROMPTS, PROMPTS[0]], params, use_tqdm=False)
    for index, reference in enumerate(expected):
        steps = outputs[str(index)]
        final = steps[-1]
        assert final.finished and not any(step.finished for step in steps[:-1])
        assert final.prompt_token_ids == reference.prompt_token_ids
        assert final.outputs[0].token_ids == reference.outputs[0].token_ids
        assert final.outputs[0].text == reference.outputs[0].text
        # Cumulative outputs (vLLM's default): each step's text extends the one before.
        texts = [step.outputs[0].text for step in steps]
        assert all(later.startswith(earlier) for earlier, later in itertools.pairwise(texts))
        assert len(steps) > 1
    assert outputs["0"][-1].prompt == PROMPTS[0]
    assert outputs["2"][-1].prompt is None  # token ids without text
    assert engine.get_num_unfinished_requests() == 0


def test_aborting_a_list_of_requests_leaves_the_others_running(engine: LLMEngine) -> None:
    params = SamplingParams(temperature=0, max_tokens=8, n=2)
    for index, prompt in enumerate(PROMPTS):
        engine.add_request(f"abort-{index}", prompt, params)
    engine.step()
    engine.abort_request(["abort-0", "abort-2", "never-added"])
    outputs = _run_to_end(engine)
    assert set(outputs) <= {"abort-0", "abort-1", "abort-2"}
    finished = outputs["abort-1"][-1]
    assert finished.finished and [len(c.token_ids) for c in finished.outputs] == [8, 8]
    assert engine.page_pool.num_free_pages == engine.page_pool.num_pages


def test_bad_requests_are_refused_and_the_engine_goes_on(engine: LLMEngine) -> None:
    with pytest.raises(TypeError, match="params must be SamplingParams"):
        engine.add_request("pooling", "text", object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'prompt' or a 'prompt_token_ids'"):
        engine.add_request("empty-dict", {}, SamplingParams())
    engine.add_request("same", "text", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("same", "text", SamplingParams(max_tokens=2))
    outputs = _run_to_end(engine)
    assert list(outputs) == ["same"] and len(outputs["same"][-1].outputs[0].token_ids) == 2


def test_engine_args_take_vllm_names_and_refuse_unknown_ones(checkpoint: str) -> None:
    config = EngineArgs(
        model=checkpoint,
        enforce_eager=True,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    )
    assert not config.enable_cuda_graphs and config.num_speculative_tokens == 3
    with pytest.raises(TypeError, match=r"unknown engine arguments \['max_num_seq'\]"):
        EngineArgs(model=checkpoint, max_num_seq=4)


def test_llm_engine_is_the_llm_s_engine(checkpoint: str) -> None:
    with LLM(checkpoint, **ENGINE_KWARGS) as llm:
        engine = llm.llm_engine
        assert engine is llm.engine
        engine.add_request("direct", PROMPTS[0], SamplingParams(temperature=0, max_tokens=3))
        outputs = _run_to_end(engine)
        assert len(outputs["direct"][-1].outputs[0].token_ids) == 3
