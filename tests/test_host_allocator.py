"""Freed host memory stays with the process for reuse, unless VACPACK_HOST_MALLOC=0.

Each case runs in a fresh interpreter: the setting is process-wide and one-way.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# Touches 256 MiB in one tensor, frees it and reports how much of it is still resident.
_PROBE = """
import json, os, torch
from vacpack.host_memory import keep_freed_host_memory

def resident_bytes():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

applied = keep_freed_host_memory()
before = resident_bytes()
block = torch.ones(256 << 20, dtype=torch.uint8)
del block
print(json.dumps({"applied": applied, "kept_bytes": resident_bytes() - before}))
"""


def _probe(setting: str | None) -> dict[str, object]:
    env = dict(os.environ)
    env.pop("VACPACK_HOST_MALLOC", None)
    if setting is not None:
        env["VACPACK_HOST_MALLOC"] = setting
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_blocks_stay_resident_for_reuse() -> None:
    kept = _probe(None)
    assert kept["applied"] is True
    assert kept["kept_bytes"] >= 200 << 20

    returned = _probe("0")
    assert returned["applied"] is False
    assert returned["kept_bytes"] < 64 << 20
