"""A Hugging Face Hub stand-in on 127.0.0.1 for upload tests: the endpoints that
``huggingface_hub``'s ``create_repo`` and ``upload_folder`` use (repository creation,
model-card metadata validation, the file listing ``delete_patterns`` reads, pre-upload,
commit), nothing more.

Every file is accepted as a "regular" (inline, base64) upload, so the commit
carries the bytes themselves; ``files`` holds them per repository, and a commit's
deleted files leave it.
"""

from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeHub:
    def __init__(self, *, refuse_with: int | None = None) -> None:
        self.repos: dict[str, dict] = {}  # repo id -> create_repo payload
        self.files: dict[str, dict[str, bytes]] = {}  # repo id -> path -> bytes
        self.commits: list[dict] = []  # commit headers
        self.validated: list[str] = []  # model cards sent for metadata validation
        self.refuse_with = refuse_with  # answer every write with this status (e.g. 401)
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_args) -> None:
                pass

            def _reply(self, status: int, payload: dict | None = None) -> None:
                data = json.dumps(payload or {"error": "not found"}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                # /api/models/<org>/<name>/tree/<revision>?recursive=...: one page, every file
                parts = self.path.split("?")[0].split("/")
                if len(parts) == 7 and parts[:3] == ["", "api", "models"] and parts[5] == "tree":
                    stored = hub.files.get(f"{parts[3]}/{parts[4]}", {})
                    listing = [{"type": "file", "path": path, "size": len(data), "oid": f"{i:040x}"}
                               for i, (path, data) in enumerate(sorted(stored.items()))]
                    data = json.dumps(listing).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return None
                self._reply(404)

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if hub.refuse_with is not None:
                    return self._reply(hub.refuse_with, {"error": "Invalid credentials"})
                if self.path == "/api/validate-yaml":  # the model card's metadata block
                    hub.validated.append(json.loads(body)["content"])
                    return self._reply(200, {"warnings": []})
                if self.path == "/api/repos/create":
                    request = json.loads(body)
                    repo = f"{request['organization']}/{request['name']}"
                    hub.repos[repo] = request
                    return self._reply(200, {"url": f"{hub.endpoint}/{repo}", "name": repo})
                parts = self.path.split("/")  # /api/models/<org>/<name>/<action>/<revision>
                if len(parts) == 7 and parts[:3] == ["", "api", "models"]:
                    repo, action = f"{parts[3]}/{parts[4]}", parts[5]
                    if action == "preupload":
                        files = json.loads(body)["files"]
                        return self._reply(200, {"files": [
                            {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                            for f in files]})
                    if action == "commit":
                        stored = dict(hub.files.get(repo, {}))  # the commit applies whole or not at all
                        for line in body.decode().splitlines():
                            item = json.loads(line)
                            if item["key"] == "header":
                                hub.commits.append(item["value"])
                            elif item["key"] == "file":
                                stored[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
                            elif item["key"] == "deletedFile":
                                if item["value"]["path"] not in stored:  # as the Hub refuses it
                                    return self._reply(404, {"error": f"no {item['value']['path']}"})
                                del stored[item["value"]["path"]]
                        hub.files[repo] = stored
                        oid = f"{len(hub.commits):040x}"
                        return self._reply(200, {"commitUrl": f"{hub.endpoint}/{repo}/commit/{oid}",
                                                 "commitOid": oid, "pullRequestUrl": None})
                self._reply(404)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self.server.shutdown()
        self.server.server_close()
