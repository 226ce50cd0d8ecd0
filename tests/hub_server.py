"""A loopback stand-in for the Hugging Face Hub: only the endpoints huggingface_hub's create_repo,
create_branch and upload_folder (with delete_patterns: the tree listing, a commit's deletions) call, plus injectable
faults. Files are kept in memory.

Run as a program (`python hub_server.py --port P --dump DIR`, the token from $HF_TOKEN) it serves until killed
and also writes every committed file to DIR/<repo>/<branch>/<path>; scripts/test_container.sh runs it so.

Faults: `server.faults[endpoint]` is a list consumed one request at a time ("500", "drop" = close the
connection without answering, "hang" = answer after `hang_seconds`, "403", "404"); `server.always[endpoint]`
applies to every request. Endpoints: create, branch, validate, preupload, commit, tree.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Optional

ROUTES = (
    ("create", "POST", re.compile(r"^/api/repos/create$")),
    ("branch", "POST", re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/branch/(?P<rev>[^/?]+)$")),
    ("validate", "POST", re.compile(r"^/api/validate-yaml$")),
    ("preupload", "POST", re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/preupload/(?P<rev>[^/?]+)$")),
    ("commit", "POST", re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/commit/(?P<rev>[^/?]+)$")),
    ("tree", "GET", re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/tree/(?P<rev>[^/?]+)$")),
)


class FakeHub(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, token: str, port: int = 0, dump_dir: Optional[Path] = None):
        super().__init__(("127.0.0.1", port), _Handler)
        self.token = token
        self.dump_dir = dump_dir
        self.faults: dict[str, list[str]] = {}
        self.always: dict[str, str] = {}
        self.hang_seconds = 5.0
        self.log: list[tuple[str, str, int]] = []  # (endpoint, path, status or -1 for a drop)
        self.repos: dict[str, dict] = {}  # repo id -> {"private": bool, "branches": {name: {path: bytes}}}
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def start(self) -> "FakeHub":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()

    def next_fault(self, endpoint: str) -> Optional[str]:
        with self.lock:
            if endpoint in self.always:
                return self.always[endpoint]
            queue = self.faults.get(endpoint) or []
            return queue.pop(0) if queue else None

    def count(self, endpoint: str) -> int:
        return sum(1 for name, _, _ in self.log if name == endpoint)


class _Handler(BaseHTTPRequestHandler):
    server: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet
        pass

    def _reply(self, endpoint: str, status: int, payload: dict) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.server.log.append((endpoint, self.path, status))

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def _serve(self, method: str) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))
        path = self.path.split("?")[0]
        for endpoint, route_method, pattern in ROUTES:
            match = pattern.match(path)
            if match and route_method == method:
                break
        else:
            self._reply("unknown", 404, {"error": f"not implemented: {method} {path}"})
            return
        if self.headers.get("Authorization") != f"Bearer {self.server.token}":
            self._reply(endpoint, 401, {"error": "Invalid credentials"})
            return
        fault = self.server.next_fault(endpoint)
        if fault == "drop":
            self.server.log.append((endpoint, path, -1))
            self.close_connection = True
            self.connection.shutdown(2)
            return
        if fault == "hang":
            time.sleep(self.server.hang_seconds)
        elif fault in ("500", "403", "404"):
            self._reply(endpoint, int(fault), {"error": f"injected {fault}"})
            return
        getattr(self, f"_{endpoint}")(endpoint, body, match.groupdict())

    def _create(self, endpoint: str, body: bytes, groups: dict) -> None:
        payload = json.loads(body)
        repo = f"{payload.get('organization') or 'user'}/{payload['name']}"
        with self.server.lock:
            exists = repo in self.server.repos
            if not exists:
                self.server.repos[repo] = {"private": payload.get("visibility") == "private", "branches": {"main": {}}}
        if exists:
            self._reply(endpoint, 409, {"error": "You already created this model repo", "url": self._url(repo)})
        else:
            self._reply(endpoint, 200, {"url": self._url(repo), "name": repo, "id": repo})

    def _branch(self, endpoint: str, body: bytes, groups: dict) -> None:
        branches = self.server.repos[groups["repo"]]["branches"]
        if groups["rev"] in branches:
            self._reply(endpoint, 409, {"error": "Reference already exists"})
            return
        branches[groups["rev"]] = dict(branches["main"])
        self._reply(endpoint, 200, {})

    def _validate(self, endpoint: str, body: bytes, groups: dict) -> None:
        self._reply(endpoint, 200, {"errors": [], "warnings": []})

    def _preupload(self, endpoint: str, body: bytes, groups: dict) -> None:
        files = json.loads(body)["files"]
        self._reply(endpoint, 200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False,
                                               "oid": None} for f in files]})

    def _tree(self, endpoint: str, body: bytes, groups: dict) -> None:
        """The branch's files, all in one page (what list_repo_files reads; folders are not listed)."""
        files = self.server.repos[groups["repo"]]["branches"].get(groups["rev"], {})
        self._reply(endpoint, 200, [{"type": "file", "path": path, "size": len(data),
                                     "oid": hashlib.sha1(data).hexdigest()} for path, data in sorted(files.items())])

    def _commit(self, endpoint: str, body: bytes, groups: dict) -> None:
        branch = self.server.repos[groups["repo"]]["branches"].setdefault(groups["rev"], {})
        for line in body.splitlines():
            item = json.loads(line)
            if item["key"] in ("deletedFile", "deletedFolder"):
                gone = item["value"]["path"]
                inside = item["key"] == "deletedFolder"
                for path in [p for p in branch if p == gone or inside and p.startswith(gone.rstrip("/") + "/")]:
                    del branch[path]
                    if self.server.dump_dir is not None:
                        (self.server.dump_dir / groups["repo"] / groups["rev"] / path).unlink(missing_ok=True)
            if item["key"] == "file":
                branch[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
                if self.server.dump_dir is not None:
                    target = self.server.dump_dir / groups["repo"] / groups["rev"] / item["value"]["path"]
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(branch[item["value"]["path"]])
        oid = hashlib.sha1(body).hexdigest()
        self._reply(endpoint, 200, {"commitUrl": f"{self._url(groups['repo'])}/commit/{oid}", "commitOid": oid,
                                    "success": True})

    def _url(self, repo: str) -> str:
        return f"{self.server.url}/{repo}"


def main() -> None:
    parser = argparse.ArgumentParser(description="serve the loopback Hub until killed (token from $HF_TOKEN)")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--dump", type=Path, required=True, help="committed files are written under this directory")
    args = parser.parse_args()
    server = FakeHub(os.environ["HF_TOKEN"], args.port, args.dump)
    print(f"hub_server: serving {server.url}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
