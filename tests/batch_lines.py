"""Run-batch files for tests: lines written to a real file, run, and their answers read back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vacpack import LLM
from vacpack.batch.options import BatchOptions
from vacpack.batch.runner import run_batch


def answer_lines(llm: LLM, lines: list[dict[str, Any]], directory: Path) -> dict[str, Any]:
    """Each line's `response` (status_code and body), by custom_id, after `run_batch`."""
    input_path = directory / "in.jsonl"
    input_path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    options = BatchOptions(input_path, directory / "out.jsonl", show_progress=False)
    run_batch(llm, options)
    records = [json.loads(line) for line in options.output_path.read_text().splitlines()]
    return {record["custom_id"]: record["response"] for record in records}
