"""Imports each module named on the command line and prints its version; exits non-zero
naming every one that does not import. The GPU and CPU session scripts' set-up check.

    python bench/check_imports.py vacpack torch transformers
"""

from __future__ import annotations

import importlib
import sys


def main(names: list[str]) -> int:
    missing = []
    for name in names:
        try:
            module = importlib.import_module(name)
            print(f"  {name} {getattr(module, '__version__', '')}")
        except Exception as error:  # every kind of import failure is reported, not raised
            missing.append(f"{name} ({type(error).__name__}: {error})")
    if missing:
        print("missing: " + "; ".join(missing), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
