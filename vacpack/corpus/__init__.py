"""Corpus jobs: documents packed into padding-free bins, produced ahead of the device."""

from vacpack.corpus.packing import (
    PADDING_DOC_INDEX,
    Document,
    DocumentError,
    FirstFitDecreasingPacker,
    PackedBin,
    PackerOutput,
)
from vacpack.corpus.pipeline import BackgroundBins

__all__ = [
    "PADDING_DOC_INDEX",
    "BackgroundBins",
    "Document",
    "DocumentError",
    "FirstFitDecreasingPacker",
    "PackedBin",
    "PackerOutput",
]
