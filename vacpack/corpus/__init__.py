"""Corpus jobs: documents packed into padding-free bins, produced ahead of the device.

The names below are imported when first used: Ray Data's reading tasks import
`vacpack.corpus.input_fields` in worker processes that must not pay for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vacpack.corpus.packing import (
        PADDING_DOC_INDEX,
        Document,
        DocumentError,
        FirstFitDecreasingPacker,
        PackedBin,
        PackerOutput,
    )
    from vacpack.corpus.pipeline import BackgroundBins

_EXPORTS = {
    "PADDING_DOC_INDEX": "vacpack.corpus.packing",
    "BackgroundBins": "vacpack.corpus.pipeline",
    "Document": "vacpack.corpus.packing",
    "DocumentError": "vacpack.corpus.packing",
    "FirstFitDecreasingPacker": "vacpack.corpus.packing",
    "PackedBin": "vacpack.corpus.packing",
    "PackerOutput": "vacpack.corpus.packing",
}

__all__ = [
    "PADDING_DOC_INDEX",
    "BackgroundBins",
    "Document",
    "DocumentError",
    "FirstFitDecreasingPacker",
    "PackedBin",
    "PackerOutput",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'vacpack.corpus' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
