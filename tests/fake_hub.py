"""A Hugging Face hub on 127.0.0.1: the endpoints huggingface_hub's snapshot_download calls.

Point HF_ENDPOINT at `FakeHub.url` and the hub's own client downloads from it as from the real
hub (huggingface_hub 2.x): model info at a revision (GET /api/models/{repo}/revision/{rev}), the
file tree at the commit it names (GET /api/models/{repo}/tree/{commit}), then each file's
metadata (HEAD /{repo}/resolve/{commit}/{file}: X-Repo-Commit, ETag, Content-Length) and
content (GET). Unknown repositories, revisions and files get the 404s with the X-Error-Code
the real hub sends. Every request is recorded, so a test can tell whether the hub was asked.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

LOOPBACK = "127.0.0.1"


@dataclass
class FakeHub:
    # repo id -> revision name -> directory whose files the revision holds
    repos: dict[str, dict[str, Path]]
    url: str = ""
    requests: list[str] = field(default_factory=list)

    def commit(self, repo_id: str, revision: str) -> str:
        return hashlib.sha1(f"{repo_id}@{revision}".encode()).hexdigest()

    def find(self, repo_id: str, revision: str) -> tuple[str, Path] | None:
        """(commit hash, directory of its files) for a revision named by branch or by commit."""
        for name, directory in self.repos.get(repo_id, {}).items():
            commit = self.commit(repo_id, name)
            if revision in (name, commit):
                return commit, directory
        return None


def _split_repo(path: str) -> tuple[str, str]:
    """("org/name", rest) for "org/name/rest"."""
    org, name, rest = [*path.split("/", 2), "", ""][:3]
    return f"{org}/{name}", rest


def _handler_for(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:  # quiet
            pass

        def do_HEAD(self) -> None:
            self._answer(send_body=False)

        def do_GET(self) -> None:
            self._answer(send_body=True)

        def _answer(self, send_body: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            hub.requests.append(f"{self.command} {path}")
            if path.startswith("/api/models/"):
                self._api(path.removeprefix("/api/models/"), send_body)
            else:
                self._resolve(path.removeprefix("/"), send_body)

        def _api(self, path: str, send_body: bool) -> None:
            repo_id, rest = _split_repo(path)
            if repo_id not in hub.repos:
                return self._error(404, "RepoNotFound")
            kind, _, revision = rest.partition("/")
            revision = revision or "main"
            found = hub.find(repo_id, revision)
            if found is None:
                return self._error(404, "RevisionNotFound")
            commit, directory = found
            files = sorted(p for p in directory.iterdir() if p.is_file())
            if kind == "tree":
                body = [
                    {"type": "file", "path": p.name, "size": p.stat().st_size, "oid": _oid(p)}
                    for p in files
                ]
            else:
                siblings = [{"rfilename": p.name} for p in files]
                body = {"id": repo_id, "sha": commit, "siblings": siblings, "private": False}
            self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"}, True)

        def _resolve(self, path: str, send_body: bool) -> None:
            repo_id, rest = _split_repo(path)
            revision, _, filename = rest.removeprefix("resolve/").partition("/")
            found = hub.find(repo_id, revision)
            if found is None:
                known = repo_id in hub.repos
                return self._error(404, "RevisionNotFound" if known else "RepoNotFound")
            commit, directory = found
            file_path = directory / filename
            if not file_path.is_file():
                return self._error(404, "EntryNotFound")
            data = file_path.read_bytes()
            headers = {"X-Repo-Commit": commit, "ETag": f'"{_oid(file_path)}"'}
            self._send(200, data, headers, send_body)

        def _error(self, status: int, error_code: str) -> None:
            body = json.dumps({"error": error_code}).encode()
            self._send(status, body, {"X-Error-Code": error_code}, True)

        def _send(self, status: int, body: bytes, headers: dict[str, str], send_body: bool) -> None:
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if send_body and self.command != "HEAD":
                self.wfile.write(body)

    return Handler


def _oid(path: Path) -> str:
    return hashlib.sha1(path.read_bytes()).hexdigest()


@contextmanager
def serving(hub: FakeHub) -> Iterator[FakeHub]:
    server = ThreadingHTTPServer((LOOPBACK, 0), _handler_for(hub))
    hub.url = f"http://{LOOPBACK}:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
