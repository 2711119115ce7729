"""A local stand-in for the Hugging Face Hub's HTTP API: folders served as model repositories.

Tests never reach the internet, yet an `hf://ORG/NAME[@REVISION]` source is fetched by the real
`huggingface_hub.snapshot_download` (the init container the operator renders, operator/builders.py).
`HubStandin` answers that client the way the Hub does, pointed at by `HF_ENDPOINT`:

- `GET /api/models/ORG/NAME/revision/REV`: the repository's commit (`sha`) and its files (`siblings`);
- `GET /api/models/ORG/NAME/tree/REV[/PATH]?recursive=...`: files (size, git blob id) and folders;
- `HEAD` / `GET /ORG/NAME/resolve/REV/PATH`: a file, with `X-Repo-Commit`, `ETag` and `Content-Length`.

A revision is `main` or the repository's commit, a hash of its files' paths and contents, so a changed
folder is a new commit. With `token` set every request needs `Authorization: Bearer TOKEN` (a private
or gated model: 401 otherwise, as the Hub answers); unknown repositories, revisions and files are 404
with the Hub's `X-Error-Code`. Every request's method and path is recorded in `requests`, so a test can
show the files came from here. One thread a connection (ThreadingHTTPServer); stop() closes it.
"""

from __future__ import annotations

import hashlib
import json
import threading
import urllib.parse
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path, PurePosixPath
from typing import Any

DEFAULT_BRANCH = "main"
CHUNK = 1 << 20


def blob_id(data: bytes) -> str:
    """git's blob id of a file (what the Hub reports as a non-LFS file's oid and ETag)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class _Repo:
    def __init__(self, root: Path) -> None:
        self.files = {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*")) if p.is_file()}
        self.blobs = {rel: blob_id(path.read_bytes()) for rel, path in self.files.items()}
        digest = hashlib.sha1()
        for rel, blob in self.blobs.items():
            digest.update(f"{rel}\0{blob}\n".encode())
        self.sha = digest.hexdigest()

    def folders(self) -> list[str]:
        return sorted({str(d) for rel in self.files for d in PurePosixPath(rel).parents} - {"."})


class HubStandin:
    """Serve `repos` ({"ORG/NAME": folder}) on `host`; `url` is what HF_ENDPOINT takes."""

    def __init__(
        self, repos: Mapping[str, Path], *, token: str | None = None, host: str = "127.0.0.1"
    ) -> None:
        self.repos = {name: _Repo(Path(folder)) for name, folder in repos.items()}
        self.token = token
        self._host = host
        self.requests: list[str] = []
        self._lock = threading.Lock()
        standin = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                standin._answer(self, body=True)

            def do_HEAD(self) -> None:
                standin._answer(self, body=False)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer((host, 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="hub-standin", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self._host}:{self._server.server_port}"

    def commit(self, repo: str) -> str:
        return self.repos[repo].sha

    def start(self) -> HubStandin:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> HubStandin:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- requests

    def _answer(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        parsed = urllib.parse.urlsplit(h.path)
        with self._lock:
            self.requests.append(f"{h.command} {parsed.path}")
        if self.token is not None and h.headers.get("Authorization") != f"Bearer {self.token}":
            return self._error(h, 401, "GatedRepo", "Invalid credentials in Authorization header", body)
        parts = [urllib.parse.unquote(p) for p in parsed.path.strip("/").split("/")]
        query = urllib.parse.parse_qs(parsed.query)
        if len(parts) >= 6 and parts[:2] == ["api", "models"] and parts[4] == "revision":
            return self._revision(h, f"{parts[2]}/{parts[3]}", "/".join(parts[5:]), body)
        if len(parts) >= 6 and parts[:2] == ["api", "models"] and parts[4] == "tree":
            recursive = query.get("recursive", ["false"])[0].lower() in ("1", "true")
            return self._tree(h, f"{parts[2]}/{parts[3]}", parts[5], "/".join(parts[6:]), recursive, body)
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._resolve(h, f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:]), body)
        return self._error(h, 404, "EntryNotFound", f"no such endpoint: {parsed.path}", body)

    def _repo(self, h: BaseHTTPRequestHandler, name: str, revision: str, body: bool) -> _Repo | None:
        repo = self.repos.get(name)
        if repo is None:
            self._error(h, 404, "RepoNotFound", f"Repository not found: {name}", body)
            return None
        if revision not in (DEFAULT_BRANCH, repo.sha):
            self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {revision}", body)
            return None
        return repo

    def _revision(self, h: BaseHTTPRequestHandler, name: str, revision: str, body: bool) -> None:
        repo = self._repo(h, name, revision, body)
        if repo is None:
            return
        info = {
            "_id": repo.sha[:24],
            "id": name,
            "modelId": name,
            "sha": repo.sha,
            "private": self.token is not None,
            "gated": False,
            "disabled": False,
            "tags": [],
            "siblings": [{"rfilename": rel} for rel in repo.files],
        }
        self._json(h, info, body)

    def _tree(
        self, h: BaseHTTPRequestHandler, name: str, revision: str, under: str, recursive: bool, body: bool
    ) -> None:
        repo = self._repo(h, name, revision, body)
        if repo is None:
            return
        prefix = f"{under.strip('/')}/" if under.strip("/") else ""

        def wanted(path: str) -> bool:
            if not path.startswith(prefix):
                return False
            return recursive or "/" not in path[len(prefix) :]

        entries: list[dict[str, Any]] = [
            {"type": "directory", "oid": hashlib.sha1(d.encode()).hexdigest(), "size": 0, "path": d}
            for d in repo.folders()
            if wanted(d)
        ]
        entries += [
            {"type": "file", "oid": repo.blobs[rel], "size": path.stat().st_size, "path": rel}
            for rel, path in repo.files.items()
            if wanted(rel)
        ]
        self._json(h, entries, body)

    def _resolve(self, h: BaseHTTPRequestHandler, name: str, revision: str, rel: str, body: bool) -> None:
        repo = self._repo(h, name, revision, body)
        if repo is None:
            return
        path = repo.files.get(rel)
        if path is None:
            return self._error(h, 404, "EntryNotFound", f"{rel} does not exist on {revision}", body)
        size = path.stat().st_size
        h.send_response(200)
        h.send_header("Content-Type", "application/octet-stream")
        h.send_header("Content-Length", str(size))
        h.send_header("X-Repo-Commit", repo.sha)
        h.send_header("ETag", f'"{repo.blobs[rel]}"')
        h.end_headers()
        if body:
            with path.open("rb") as f:
                while chunk := f.read(CHUNK):
                    h.wfile.write(chunk)

    def _json(
        self, h: BaseHTTPRequestHandler, value: object, body: bool, status: int = 200, **headers: str
    ) -> None:
        data = json.dumps(value).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        for name, header in headers.items():
            h.send_header(name.replace("_", "-"), header)
        h.end_headers()
        if body:
            h.wfile.write(data)

    def _error(self, h: BaseHTTPRequestHandler, status: int, code: str, message: str, body: bool) -> None:
        self._json(h, {"error": message}, body, status, X_Error_Code=code, X_Error_Message=message)
