"""Priority scheduling through LLM and run-batch files (vLLM's scheduling_policy="priority"):
requests run by priority, lower first, with the same outputs; fcfs refuses a priority."""

from __future__ import annotations

import pytest
from batch_lines import answer_lines

from vacpack import LLM, SamplingParams

PROMPTS = [[5, 6, 7], [8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18]]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint):
    return tiny_checkpoint("qwen2")


def test_requests_run_by_priority_with_the_same_outputs(model_dir) -> None:
    # One sequence at a time: the order they start in is the order they are admitted.
    ordered = LLM(str(model_dir), dtype="float32", max_num_seqs=1, scheduling_policy="priority")
    outputs = ordered.generate(PROMPTS, GREEDY, use_tqdm=False, priority=[3, 0, 2, -1])
    starts = [output.metrics.first_scheduled_time for output in outputs]
    assert sorted(range(len(PROMPTS)), key=starts.__getitem__) == [3, 1, 2, 0]
    plain = LLM(str(model_dir), dtype="float32", max_num_seqs=1)
    expected = plain.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]
    with pytest.raises(ValueError, match="priority scheduling is not enabled"):
        plain.generate(PROMPTS[:1], GREEDY, use_tqdm=False, priority=[1])
    with pytest.raises(ValueError, match="got 1 priorities for 4 prompts"):
        ordered.generate(PROMPTS, GREEDY, use_tqdm=False, priority=[1])
    with pytest.raises(ValueError, match="priority must be an integer"):
        ordered.generate(PROMPTS[:1], GREEDY, use_tqdm=False, priority=[0.5])
    assert plain.generate(PROMPTS[:1], GREEDY, use_tqdm=False, priority=[0])  # 0 is fcfs's


def test_run_batch_lines_carry_their_priority(model_dir, tmp_path) -> None:
    llm = LLM(str(model_dir), dtype="float32", max_num_seqs=1, scheduling_policy="priority")
    lines = [
        {"custom_id": name, "method": "POST", "url": "/v1/completions",
         "body": {"prompt": PROMPTS[i], "max_tokens": 4, "temperature": 0, "priority": p}}
        for i, (name, p) in enumerate((("late", 9), ("first", -2), ("bad", "high")))
    ]  # fmt: skip
    responses = answer_lines(llm, lines, tmp_path)
    status = {custom_id: response["status_code"] for custom_id, response in responses.items()}
    assert status == {"late": 200, "first": 200, "bad": 400}
