"""The gpu-check's requests to the SGLang server it starts on loopback bypass any proxy.

A security review noted urllib's default opener sends a request for 127.0.0.1 to
``$http_proxy`` unless ``$no_proxy`` lists it: the check's prompts would go to the proxy, or
fail against it. A loopback server here answers; the proxy named is a closed port.
"""

from __future__ import annotations

import http.server
import json
import threading
import urllib.request

from draftforge.splitserve import gpu_check_serving


class _Answer(http.server.BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 - http.server's name
        length = int(self.headers["Content-Length"])
        body = json.dumps({"echo": json.loads(self.rfile.read(length))}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_request_to_the_local_server_goes_direct_whatever_the_proxy_settings(monkeypatch):
    server = http.server.HTTPServer(("127.0.0.1", 0), _Answer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        for name in ("http_proxy", "HTTP_PROXY"):
            monkeypatch.setenv(name, "http://127.0.0.1:9")  # the discard port: nothing listens
        for name in ("no_proxy", "NO_PROXY"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setattr(urllib.request, "_opener", None)  # urlopen's opener reads them anew
        status, body = gpu_check_serving._http(f"http://127.0.0.1:{server.server_port}/generate", {"text": "hi"},
                                               timeout_s=10)
        assert (status, body) == (200, {"echo": {"text": "hi"}})
    finally:
        server.shutdown()
        server.server_close()
