"""The sampling a model's authors recommend, from its generation_config.json, as the defaults of
requests that leave a field out (as vLLM's `--generation-config auto`, its default).

Chat models ship them: Qwen2.5-Instruct, for one, temperature 0.7, top_p 0.8, top_k 20 and
repetition_penalty 1.05. A client moved from vLLM that sends only `messages` gets the same
sampling here. A field a request gives always wins; an explicit SamplingParams is used as given.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from vacpack.tokenizer import GENERATION_CONFIG_FILENAME

logger = logging.getLogger(__name__)

# generation_config.json's name -> SamplingParams' name, for the fields vLLM reads too.
SAMPLING_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
# generation_config="vllm": the library's own defaults, whatever the model recommends (the
# value vLLM gives the same flag).
LIBRARY_DEFAULTS = "vllm"


def sampling_defaults(generation_config: str, model_dir: Path) -> dict[str, Any]:
    """SamplingParams fields the model recommends: generation_config is "auto" (the model's own
    generation_config.json, where it has one), "vllm" (none), or a folder holding a
    generation_config.json."""
    if generation_config == LIBRARY_DEFAULTS:
        return {}
    if generation_config == "auto":
        path = Path(model_dir) / GENERATION_CONFIG_FILENAME
        if not path.is_file():
            return {}
    else:
        path = Path(generation_config) / GENERATION_CONFIG_FILENAME
        if not path.is_file():
            raise ValueError(
                f"generation_config: {path} does not exist; give auto, {LIBRARY_DEFAULTS}, or a "
                f"folder holding a {GENERATION_CONFIG_FILENAME}"
            )
    try:
        recommended = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is not a JSON object: {error}") from None
    if not isinstance(recommended, dict):
        raise ValueError(f"{path} is not a JSON object")
    defaults = {
        params_name: recommended[config_name]
        for config_name, params_name in SAMPLING_FIELDS.items()
        if recommended.get(config_name) is not None
    }
    if defaults:
        logger.info(
            "requests' sampling defaults from %s: %s (generation_config=%s to ignore them)",
            path,
            defaults,
            LIBRARY_DEFAULTS,
        )
    return defaults
