"""Servers for the tests: `dsv4 serve` as a process, the app in process, /metrics scraped.
(No openai import: the GPU machine's image lacks it; tests/test_server_gpu.py runs there.)"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from dsv4.config import ServerConfig
from dsv4.server import Server, build_app

ROOT = Path(__file__).resolve().parents[1]


class ServerProcess:
    """`python -m dsv4.cli serve` on a free loopback port; its log goes to a file."""

    def __init__(self, model_dir: Path, log: Path, *flags: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [
            sys.executable,
            "-m",
            "dsv4.cli",
            "serve",
            "--model",
            str(model_dir),
            "--device",
            "cpu",
        ]
        cmd += ["--port", str(self.port), *flags]
        with open(log, "w") as fh:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT)
        self.health: list[int] = []  # /health statuses seen while starting
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"server exited:\n{log.read_text()}"
            try:
                r = httpx.get(self.url + "/health", timeout=5)
            except httpx.TransportError:
                time.sleep(0.01)
                continue
            self.health.append(r.status_code)
            if r.status_code == 200:
                return
            assert r.status_code == 503 and r.json()["error"]["code"] == 503, r.text
            time.sleep(0.01)
        self.stop()
        raise AssertionError(f"server not ready in time:\n{log.read_text()}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def in_process(model_dir: Path | None, **config) -> tuple[Server, httpx.AsyncClient]:  # noqa: ANN003
    server = Server(ServerConfig(model=str(model_dir) if model_dir else None, **config))
    if model_dir is not None:
        server.load()
    transport = httpx.ASGITransport(app=build_app(server), raise_app_exceptions=False)
    return server, httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60)


def scrape(url: str) -> dict[str, float]:
    """/metrics as {'name{labels}': value}."""
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out
