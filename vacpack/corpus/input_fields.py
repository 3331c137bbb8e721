"""Which field of a JSON record holds a document's text, wherever records are read (corpus
files, Ray Data columns)."""

from __future__ import annotations

TEXT_KEYS = ("text", "input", "prompt")
