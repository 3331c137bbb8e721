"""Class labels of a sequence classifier, read from a Hugging Face config."""

from __future__ import annotations

from typing import Any


def id2label_from_hf(hf_config: Any, num_labels: int) -> dict[int, str]:
    """Label names by class index; LABEL_i for any index the config does not name.

    config.json stores the keys as strings ("0"); transformers usually converts them to ints, but
    a config built by hand may not have, so both are accepted.
    """
    named = {
        int(index): str(name)
        for index, name in (getattr(hf_config, "id2label", None) or {}).items()
    }
    return {index: named.get(index, f"LABEL_{index}") for index in range(num_labels)}


def num_labels_from_hf(hf_config: Any) -> int:
    # transformers derives num_labels from id2label; a missing id2label means its default of 2.
    num_labels = getattr(hf_config, "num_labels", None)
    if num_labels is None:
        num_labels = len(getattr(hf_config, "id2label", None) or {}) or 2
    if num_labels < 1:
        raise ValueError(f"a sequence classifier needs num_labels >= 1, got {num_labels}")
    return int(num_labels)
