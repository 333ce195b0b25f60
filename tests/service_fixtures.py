"""The service under test: in-process (a TestClient) or as its own `densekit serve` process, over the
`served` collection and `retriever` fixtures of conftest."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from fastapi.testclient import TestClient

from densekit.retrieval.retriever import Retriever
from densekit.serving.app import Limits, create_app

TOKEN = "s3cret-token"


def client(retriever: Retriever, **limits) -> TestClient:
    """The service over `retriever` with the test token and `limits`, in this process."""
    return TestClient(create_app(retriever, TOKEN, Limits(**limits)))


AUTH = {"Authorization": f"Bearer {TOKEN}"}


def free_port() -> int:
    """A port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_process(served, tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    """`densekit serve` over the `served` collection with the test token and `extra` options, in its own
    process, once /health answers; returns the process and the service's URL."""
    data, index, model = served
    (tmp_path / "key").write_text(TOKEN + "\n")
    port = free_port()
    command = [sys.executable, "-m", "densekit", "serve", str(model), str(index), "--corpus", str(data),
               "--port", str(port), "--api-key-file", str(tmp_path / "key"), "--device", "cpu",
               *extra]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return process, url
        except httpx.TransportError:
            if process.poll() is not None:
                raise AssertionError(process.stdout.read()) from None
            time.sleep(0.1)
    process.kill()
    raise AssertionError("the service did not start")
