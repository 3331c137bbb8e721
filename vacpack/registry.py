"""A name -> implementation table whose entries are imported only when first asked for.

Model families and attention backends register as "package.module:attribute" strings, so that
importing vacpack never imports triton, the C kernels or every model family: only the one a
checkpoint or device needs is loaded.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Generic, TypeVar

T = TypeVar("T")


class LazyRegistry(Generic[T]):
    def __init__(self, kind: str, targets: Mapping[str, str] | None = None) -> None:
        self.kind = kind  # what an entry is, for error messages ("attention backend")
        self._targets: dict[str, str] = {}
        self._loaded: dict[str, T] = {}
        for name, target in (targets or {}).items():
            self.register(name, target)

    def register(self, name: str, target: str) -> None:
        """Adds (or replaces) `name`, implemented by `target` ("package.module:attribute")."""
        module, _, attribute = target.partition(":")
        if not module or not attribute:
            raise ValueError(
                f"{self.kind} {name!r}: target must be 'module:attribute', got {target!r}"
            )
        self._targets[name] = target
        self._loaded.pop(name, None)

    def names(self) -> list[str]:
        return sorted(self._targets)

    def __contains__(self, name: object) -> bool:
        return name in self._targets

    def get(self, name: str) -> T:
        """The implementation registered as `name`, imported now if it was not yet."""
        if name not in self._loaded:
            if name not in self._targets:
                raise ValueError(
                    f"{self.kind} {name!r} is not supported; supported: {', '.join(self.names())}"
                )
            module, _, attribute = self._targets[name].partition(":")
            self._loaded[name] = getattr(importlib.import_module(module), attribute)
        return self._loaded[name]
