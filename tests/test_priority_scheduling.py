"""Priority scheduling through LLM and run-batch files (vLLM's scheduling_policy="priority"):
requests run by priority, lower first, with the same outputs; fcfs refuses a priority."""

from __future__ import annotations

import json

import pytest

from vacpack import LLM, SamplingParams
from vacpack.batch.options import BatchOptions
from vacpack.batch.runner import run_batch

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
    input_path = tmp_path / "in.jsonl"
    input_path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    options = BatchOptions(input_path, tmp_path / "out.jsonl", show_progress=False)
    run_batch(llm, options)
    records = [json.loads(line) for line in options.output_path.read_text().splitlines()]
    status = {r["custom_id"]: r["response"]["status_code"] for r in records}
    assert status == {"late": 200, "first": 200, "bad": 400}
