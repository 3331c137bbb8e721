"""Measured choices kept on disk, so that a later load on the same machine costs nothing.

A choice is valid for one CPU (model name and instruction-set flags), one torch, one vacpack
(its version, and the sources of its C kernels, which change between versions while it is
developed), one phase, one shape key and one set of candidates; all of it makes up the key,
and each key is a file of its own (named by the key's hash), so that processes measuring
different phases never rewrite each other's results. A file is written beside its target and
renamed into place, so a reader never sees half of one; a file that does not parse, or holds
another key, is measured again and rewritten.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

from vacpack.cpu_kernels.build import cpu_flags, kernel_sources_digest, user_cache_root

logger = logging.getLogger(__name__)

CACHE_ENV = "VACPACK_CHOICE_CACHE"  # where measured choices are kept


def default_cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return user_cache_root() / "choices"


@functools.cache
def cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_key() -> dict[str, str]:
    """What a timing depends on besides the phase and shapes."""
    import vacpack

    flags = " ".join(sorted(cpu_flags()))
    return {
        "cpu_model": cpu_model_name(),
        "cpu_flags_sha256": hashlib.sha256(flags.encode()).hexdigest()[:16],
        "cuda_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "",
        "torch": torch.__version__,
        "vacpack": vacpack.__version__,
        "cpu_kernels_sha256": kernel_sources_digest(),
    }


def choice_key(phase: str, shape_key: str, candidate_names: list[str]) -> dict[str, Any]:
    return {
        **machine_key(),
        "phase": phase,
        "shape_key": shape_key,
        "candidates": sorted(candidate_names),
    }


class ChoiceCache:
    """One JSON file per key under `directory`."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path_for(self, key: dict[str, Any]) -> Path:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
        readable = re.sub(r"[^A-Za-z0-9_.-]", "_", key["phase"])  # the hash alone is the key
        return self.directory / f"{readable}-{digest}.json"

    def load(self, key: dict[str, Any]) -> dict[str, Any] | None:
        """The stored entry for `key`; None where there is none or it cannot be trusted."""
        path = self.path_for(key)
        try:
            entry = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as error:
            logger.warning("measured-choice cache %s unreadable (%s): measuring again", path, error)
            return None
        if not _is_valid_entry(entry, key):
            logger.warning("measured-choice cache %s malformed: measuring again", path)
            return None
        return entry

    def store(self, key: dict[str, Any], entry: dict[str, Any]) -> None:
        """Writes atomically; a cache that cannot be written only costs a later re-measure."""
        path = self.path_for(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            handle, partial = tempfile.mkstemp(dir=path.parent, suffix=".json.partial")
            try:
                with os.fdopen(handle, "w") as partial_file:
                    json.dump({"key": key, **entry}, partial_file, indent=1)
                os.replace(partial, path)
            finally:
                if os.path.exists(partial):
                    os.unlink(partial)
        except OSError as error:
            logger.warning("measured choice not cached (%s): %s", path, error)


def _is_valid_entry(entry: Any, key: dict[str, Any]) -> bool:
    if not isinstance(entry, dict) or entry.get("key") != key:
        return False
    chosen, times = entry.get("chosen"), entry.get("best_time_s")
    return (
        isinstance(chosen, str)
        and chosen in key["candidates"]
        and isinstance(times, dict)
        and all(isinstance(v, int | float) for v in times.values())
        and isinstance(entry.get("failed", {}), dict)
        and isinstance(entry.get("num_rounds", 0), int)
    )
