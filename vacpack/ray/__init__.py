"""vacpack on Ray (`pip install vacpack[ray]`): corpus jobs over Ray Data, replicas on Ray Serve.

Ray does all the distribution (placement, scheduling, retries, the HTTP proxy); vacpack runs one
model per replica and packs the work it is handed. The names below import Ray only when used,
so `vacpack` itself runs without it.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "EmbedActor": "vacpack.ray.actors",
    "ClassifyActor": "vacpack.ray.actors",
    "LoglikelihoodActor": "vacpack.ray.actors",
    "GenerateActor": "vacpack.ray.actors",
    "ProcessorConfig": "vacpack.ray.processor",
    "Processor": "vacpack.ray.processor",
    "build_processor": "vacpack.ray.processor",
    "ReplicaFigures": "vacpack.ray.figures",
    "JobFigures": "vacpack.ray.figures",
    "VacpackServer": "vacpack.ray.serve",
    "VacpackDeployment": "vacpack.ray.serve",
    "build_serve_app": "vacpack.ray.serve",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'vacpack.ray' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
