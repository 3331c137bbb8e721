"""Model names resolve as huggingface_hub resolves them, against a hub served on 127.0.0.1.

huggingface_hub reads HF_ENDPOINT, HF_HUB_CACHE and HF_HUB_OFFLINE when it is imported, so
every case runs in a process of its own with those variables set, as a user's would.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_hub import FakeHub, serving

REPO_ID = "org/Tiny-0.5B-Instruct"  # a dot in the name, as in Qwen/Qwen2.5-0.5B-Instruct
REPO_ROOT = Path(__file__).resolve().parents[1]

# Resolves each (name, revision) of argv[1] and prints one JSON line per name.
_RESOLVE_SCRIPT = """
import json, sys
from vacpack.models.hub import resolve_model_path
for name, revision in json.loads(sys.argv[1]):
    try:
        print(json.dumps({"path": str(resolve_model_path(name, revision))}))
    except ValueError as error:
        print(json.dumps({"error": type(error).__name__, "message": str(error)}))
"""


@pytest.fixture(scope="module")
def hub(tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeHub]:
    main = tiny_checkpoint("qwen2")
    v2 = tmp_path_factory.mktemp("v2") / "checkpoint"
    shutil.copytree(main, v2)
    (v2 / "revision.txt").write_text("v2")
    with serving(FakeHub({REPO_ID: {"main": main, "v2": v2}})) as served:
        yield served


def _hub_env(hub: FakeHub, cache_dir: Path, offline: bool = False) -> dict[str, str]:
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(cache_dir)}
    env["HF_HUB_OFFLINE"] = "1" if offline else "0"
    env["PYTHONPATH"] = str(REPO_ROOT)
    return env


def _resolve(
    hub: FakeHub, cache_dir: Path, cwd: Path, names: list[tuple[str, str | None]], **kwargs: Any
) -> list[dict[str, str]]:
    finished = subprocess.run(
        [sys.executable, "-c", _RESOLVE_SCRIPT, json.dumps(names)],
        env=_hub_env(hub, cache_dir, **kwargs),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert finished.returncode == 0, finished.stderr
    return [json.loads(line) for line in finished.stdout.splitlines()]


def test_cli_generates_from_a_dotted_hub_id(hub: FakeHub, tmp_path: Path) -> None:
    command = [
        sys.executable, "-m", "vacpack", "generate", "--model", REPO_ID, "--dtype", "float32",
        "--prompt", "hello", "--max-tokens", "3", "--quiet",
    ]  # fmt: skip
    env = _hub_env(hub, tmp_path / "cache")
    finished = subprocess.run(
        command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert finished.returncode == 0, finished.stderr
    assert "--- 'hello'" in finished.stdout
    assert f"GET /api/models/{REPO_ID}/revision/main" in hub.requests
    assert any(r.startswith(f"GET /{REPO_ID}/resolve/") for r in hub.requests)


def test_revision_cache_and_offline_mode(hub: FakeHub, tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    main, v2 = _resolve(hub, cache_dir, tmp_path, [(REPO_ID, None), (REPO_ID, "v2")])
    for found in (main, v2):
        assert Path(found["path"]).is_relative_to(cache_dir)
        assert (Path(found["path"]) / "model.safetensors").is_file()
    assert not (Path(main["path"]) / "revision.txt").exists()
    assert (Path(v2["path"]) / "revision.txt").read_text() == "v2"

    num_requests = len(hub.requests)
    cached_main, cached_v2, missing = _resolve(
        hub,
        cache_dir,
        tmp_path,
        [(REPO_ID, None), (REPO_ID, "v2"), ("org/Other-1.5B", None)],
        offline=True,
    )
    assert (cached_main, cached_v2) == (main, v2)
    assert missing["error"] == "ModelNotFoundError"
    for words in ("org/Other-1.5B", "is not a directory", hub.url, "offline", str(cache_dir)):
        assert words in missing["message"]
    assert len(hub.requests) == num_requests, "offline mode asked the hub"


def test_errors_name_what_was_tried_locally_and_on_the_hub(hub: FakeHub, tmp_path: Path) -> None:
    no_repo, no_revision, a_path = _resolve(
        hub, tmp_path / "cache", tmp_path, [("org/Nope-1.0", None), (REPO_ID, "v9"), ("./x", None)]
    )
    assert no_repo["error"] == no_revision["error"] == "ModelNotFoundError"
    assert str(tmp_path / "org" / "Nope-1.0") in no_repo["message"]
    assert hub.url in no_repo["message"] and "no such repository" in no_repo["message"]
    assert "'v9'" in no_revision["message"] and "no such revision" in no_revision["message"]
    assert "not a Hugging Face hub id" in a_path["message"]
    assert not any("/x" in request for request in hub.requests)


def test_a_local_directory_wins_over_the_hub(hub: FakeHub, tiny_checkpoint, tmp_path) -> None:
    local = tmp_path / REPO_ID
    shutil.copytree(tiny_checkpoint("qwen2"), local)
    num_requests = len(hub.requests)
    (found,) = _resolve(hub, tmp_path / "cache", tmp_path, [(REPO_ID, None)])
    assert (tmp_path / found["path"]).resolve() == local.resolve()
    assert len(hub.requests) == num_requests
