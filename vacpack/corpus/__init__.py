"""Corpus jobs: documents packed into padding-free bins, produced ahead, staged to the device."""

from vacpack.corpus.packing import (
    PADDING_DOC_INDEX,
    Document,
    DocumentError,
    FirstFitDecreasingPacker,
    PackedBin,
    PackerOutput,
)
from vacpack.corpus.pipeline import BackgroundBins
from vacpack.corpus.staging import BinStager, StagedBin

__all__ = [
    "PADDING_DOC_INDEX",
    "BackgroundBins",
    "BinStager",
    "Document",
    "DocumentError",
    "FirstFitDecreasingPacker",
    "PackedBin",
    "PackerOutput",
    "StagedBin",
]
