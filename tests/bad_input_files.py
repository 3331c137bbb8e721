"""Broken checkpoints and files for the bad-input tests, each made from a good one."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _edit_config(model_dir: Path, **changes: Any) -> None:
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    config.update(changes)
    config_path.write_text(json.dumps(config))


def _truncate_weights(model_dir: Path) -> None:
    weights = model_dir / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])


def _remove_tokenizer(model_dir: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (model_dir / name).unlink(missing_ok=True)


def _index_names_a_missing_shard(model_dir: Path) -> None:
    weight_map = {"model.embed_tokens.weight": "model-00002-of-00002.safetensors"}
    index = {"metadata": {}, "weight_map": weight_map}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))


# name -> how a good checkpoint is broken
BROKEN_CHECKPOINTS: dict[str, Callable[[Path], None]] = {
    "truncated_weights": _truncate_weights,
    "garbage_weights": lambda d: (d / "model.safetensors").write_bytes(b"not safetensors"),
    "wrong_intermediate_size": lambda d: _edit_config(d, intermediate_size=96),
    "wrong_hidden_size": lambda d: _edit_config(d, hidden_size=32, head_dim=8),
    "extra_layer": lambda d: _edit_config(d, num_hidden_layers=3, layer_types=None),
    "invalid_config_json": lambda d: (d / "config.json").write_text("{not json"),
    "unsupported_architecture": lambda d: _edit_config(d, architectures=["WizardForCausalLM"]),
    "no_config": lambda d: (d / "config.json").unlink(),
    "no_tokenizer": _remove_tokenizer,
    "missing_shard": _index_names_a_missing_shard,
}


def build_broken_checkpoints(good: Path, root: Path) -> dict[str, Path]:
    built = {}
    for name, breaks in BROKEN_CHECKPOINTS.items():
        model_dir = root / name
        shutil.copytree(good, model_dir)
        breaks(model_dir)
        built[name] = model_dir
    return built


def batch_line(custom_id: str, url: str = "/v1/completions", **body: Any) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def completion_line(custom_id: str, **body: Any) -> str:
    fields = {"prompt": f"hello {custom_id}", "max_tokens": 2, "temperature": 0, **body}
    return batch_line(custom_id, **fields)


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def read_records(path: Path) -> list[dict[str, Any]]:
    """Every line of a results file, each required to be a whole JSON object."""
    data = path.read_bytes()
    assert not data or data.endswith(b"\n"), f"{path} ends in a torn line"
    return [json.loads(line) for line in data.decode("utf-8").splitlines()]
