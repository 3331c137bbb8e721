"""run-batch lines with vLLM's `use_beam_search` and with a LoRA adapter's name as their model
(--lora-modules): the same answers as LLM.beam_search and LLM.generate with the adapter, beside
ordinary lines in the same run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from lora_adapters import make_adapter

from vacpack import LLM, BeamSearchParams, SamplingParams, TokensPrompt
from vacpack.batch.options import BatchOptions
from vacpack.batch.prompt_file import GenerateOptions, PromptSource, run_generate_file
from vacpack.batch.runner import run_batch
from vacpack.lora.request import LoRARequest

PROMPTS = ["The weather today is", "A long time ago", "hello there"]


@pytest.fixture(scope="module")
def base_dir(tiny_checkpoint) -> Path:
    return tiny_checkpoint("qwen2")


@pytest.fixture(scope="module")
def adapter_dir(base_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_adapter(
        base_dir, tmp_path_factory.mktemp("adapter") / "sql", seed=5,
        targets=["q_proj", "v_proj", "up_proj"], r=8, lora_alpha=16,
    )  # fmt: skip


@pytest.fixture(scope="module")
def llm(base_dir: Path) -> LLM:
    return LLM(str(base_dir), dtype="float32", max_model_len=256, enable_lora=True)


def _line(custom_id: str, url: str, body: dict[str, Any]) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _run(llm: LLM, tmp_path: Path, lines: list[str], **options: Any) -> dict[str, dict]:
    input_path = tmp_path / "in.jsonl"
    input_path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    output_path = tmp_path / "out.jsonl"
    run_batch(llm, BatchOptions(input_path, output_path, show_progress=False, **options))
    records = [json.loads(line) for line in output_path.read_text(encoding="utf-8").splitlines()]
    return {record["custom_id"]: record for record in records}


def test_beam_search_lines_answer_the_best_beams(llm: LLM, tmp_path: Path) -> None:
    tokenizer = llm.get_tokenizer()
    width, max_tokens = 3, 5
    expected = llm.beam_search(
        [TokensPrompt(prompt_token_ids=tokenizer.encode(p)) for p in PROMPTS],
        BeamSearchParams(beam_width=width, max_tokens=max_tokens),
    )
    beam = {"n": width, "max_tokens": max_tokens, "use_beam_search": True}
    lines = [
        _line("beams", "/v1/completions", {"prompt": PROMPTS, **beam}),
        _line("plain", "/v1/completions", {"prompt": "x", "max_tokens": 4, "temperature": 0}),
        _line("refused", "/v1/completions", {"prompt": "x", "top_p": 0.5, **beam}),
    ]
    records = _run(llm, tmp_path, lines, max_in_flight=4)  # fewer than one step's beams
    body = records["beams"]["response"]["body"]
    texts = [choice["text"] for choice in sorted(body["choices"], key=lambda c: c["index"])]
    assert texts == [beam_.text for output in expected for beam_ in output.sequences]
    assert records["plain"]["response"]["status_code"] == 200
    refused = records["refused"]["response"]
    assert refused["status_code"] == 400 and refused["body"]["error"]["param"] == "top_p"


def test_lines_naming_an_adapter_run_it(llm: LLM, tmp_path: Path, adapter_dir: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=6)
    adapter = LoRARequest("sql", 1, str(adapter_dir))
    with_adapter = llm.generate(PROMPTS, params, use_tqdm=False, lora_request=adapter)
    base = llm.generate(PROMPTS, params, use_tqdm=False)
    lines = [
        _line(f"{model}-{index}", "/v1/completions",
              {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0})
        for index, prompt in enumerate(PROMPTS)
        for model in ["sql", "base"]
    ] + [
        _line("pooled", "/v1/embeddings", {"model": "sql", "input": "hi"}),
        _line("unknown", "/v1/completions", {"model": "nope", "prompt": "hi"}),
    ]  # fmt: skip
    records = _run(
        llm, tmp_path, lines, served_model_name="base", lora_modules=(("sql", str(adapter_dir)),)
    )
    for index in range(len(PROMPTS)):
        for model, expected in [("sql", with_adapter), ("base", base)]:
            body = records[f"{model}-{index}"]["response"]["body"]
            assert body["choices"][0]["text"] == expected[index].outputs[0].text
            assert body["model"] == "base"  # run-batch answers under the served name
    assert records["pooled"]["response"]["status_code"] == 400
    assert records["unknown"]["response"]["status_code"] == 404
    assert [o.outputs[0].text for o in with_adapter] != [o.outputs[0].text for o in base]


def test_generate_input_refuses_a_beam_search_line(llm: LLM, tmp_path: Path) -> None:
    lines = [{"prompt": "hello", "use_beam_search": True, "n": 2}, {"prompt": "hello"}]
    input_path = tmp_path / "in.jsonl"
    input_path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    options = GenerateOptions(tmp_path / "out.jsonl", show_progress=False)
    run_generate_file(llm, PromptSource(input_path), {"max_tokens": 3}, options)
    records = {
        record["index"]: record
        for record in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())
    }
    assert "use_beam_search is not supported by generate --input" in records[0]["error"]
    assert records[1]["outputs"][0]["num_tokens"] == 3
