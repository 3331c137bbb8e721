"""Checkpoint loading (sharded, tied/untied) and the command line as a real process."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from vacpack import LLM, SamplingParams
from vacpack.cli import main
from vacpack.errors import ExitCode


@pytest.mark.parametrize("tie", [True, False])
def test_sharded_checkpoints_load_the_same_model(tiny_checkpoint, tie: bool) -> None:
    whole = tiny_checkpoint("qwen2", tie_word_embeddings=tie)
    sharded = tiny_checkpoint("qwen2", tie_word_embeddings=tie, max_shard_bytes=100_000)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = list(range(3, 40))
    outputs = [
        LLM(str(path), dtype="float32").generate([prompt], params, use_tqdm=False)[0]
        for path in (whole, sharded)
    ]
    assert outputs[0].outputs[0].token_ids == outputs[1].outputs[0].token_ids


def test_missing_weights_are_named(tiny_checkpoint, tmp_path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    model_dir = tmp_path / "broken"
    shutil.copytree(tiny_checkpoint("llama"), model_dir)
    weights = load_file(model_dir / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=re.escape("layers.1.mlp.down_proj.weight")):
        LLM(str(model_dir), dtype="float32")


def test_cli_generates_from_a_prompt_file(tiny_checkpoint, tmp_path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["Hello", "The sea is"]))
    results = tmp_path / "results.jsonl"
    command = [
        sys.executable, "-m", "vacpack", "generate", "--model", str(tiny_checkpoint("llama")),
        "--dtype", "float32", "--input", str(prompts), "--output", str(results),
        "--max-tokens", "5", "--ignore-eos",
    ]  # fmt: skip
    finished = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr
    records = [json.loads(line) for line in results.read_text().splitlines()]
    records.sort(key=lambda record: record["index"])  # written as they finish
    assert [r["prompt"] for r in records] == ["Hello", "The sea is"]
    assert all(r["outputs"][0]["num_tokens"] == 5 for r in records)
    assert "output tok/s" in finished.stderr


def test_cli_reports_bad_input_clearly(tmp_path, capsys) -> None:
    exit_code = main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "hi"])
    assert exit_code == ExitCode.MODEL_NOT_FOUND
    report = capsys.readouterr().err
    assert "nope" in report and "Traceback" not in report
